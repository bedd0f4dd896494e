"""The context limit is one rule (``policy.lifecycle``): the HTTP layer refuses exactly
the requests the runtime's admission refuses, at the boundary too, and a chat request
without ``max_tokens`` gets the room admission would grant."""

from __future__ import annotations

import pytest
from trio.testing import MockClock

from actors.errors import ContextTooLong
from actors.public import Finished, GenerationRequest, SamplingParams
from app.errors import ApiError
from app.request_parsing import ChatMessage, ChatParams, CommonParams, CompletionParams
from app.service import AppSettings, FlareService
from tests.actors.toy import ToyCodec, toy_runtime

PROMPT = (1,) * 10
POOL = dict(num_pages=4, page_size=4, max_context=256)  # the pool holds 16 positions


class PlainChatCodec(ToyCodec):
    """The toy codec with a chat template its alphabet can encode."""

    @property
    def chat_template(self) -> str | None:
        return "{% for m in messages %}{{ m.content }} {% endfor %}"


class WithCodec:
    """``runtime`` as the HTTP layer sees it, speaking through ``codec``."""

    def __init__(self, runtime: object, codec: ToyCodec) -> None:
        self._runtime = runtime
        self.codec = codec

    def __getattr__(self, name: str) -> object:
        return getattr(self._runtime, name)


def common(max_tokens: int | None) -> CommonParams:
    return CommonParams(model=None, max_tokens=max_tokens, sampling=SamplingParams(
        temperature=0.0), stop=(), stream=False, include_usage=False, ignore_eos=True,
        user="")


async def admitted(runtime: object, request: GenerationRequest) -> bool:
    try:
        async with runtime.generate(request) as events:  # type: ignore[attr-defined]
            last = [event async for event in events][-1]
    except ContextTooLong:
        return False
    assert isinstance(last, Finished) and last.reason in ("length", "stop"), last
    return True


@pytest.mark.parametrize("max_tokens", [5, 6, 7])
async def test_api_and_admission_agree_at_the_context_boundary(
        autojump_clock: MockClock, max_tokens: int) -> None:
    """Prompt 10 + max_tokens against a 16-position pool (below the model's 256): 6 is
    the boundary and fits in both layers, 7 is refused by both."""
    async with toy_runtime(**POOL) as toy:
        assert toy.runtime.max_context == 16
        service = FlareService(toy.runtime, AppSettings())
        params = CompletionParams(common=common(max_tokens), prompt=PROMPT, echo=False,
                                  logprobs=False)
        try:
            service.prepare_completion(params, arrived=0.0)
            api_accepts = True
        except ApiError as exc:
            assert (exc.status, exc.code) == (400, "context_length_exceeded")
            api_accepts = False
        runtime_accepts = await admitted(toy.runtime, GenerationRequest(
            prompt_token_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True))
        assert api_accepts == runtime_accepts == (max_tokens <= 6)


async def test_chat_default_max_tokens_is_the_room_admission_grants(
        autojump_clock: MockClock) -> None:
    async with toy_runtime(**POOL) as toy:
        service = FlareService(WithCodec(toy.runtime, PlainChatCodec()),  # type: ignore[arg-type]
                               AppSettings())
        prepared = service.prepare_chat(ChatParams(
            common=common(None), messages=(ChatMessage(role="user", content="abc"),),
            logprobs=False), arrived=0.0)
        request = prepared.request
        assert len(request.prompt_token_ids) + request.max_tokens == 16
        assert await admitted(toy.runtime, request)
