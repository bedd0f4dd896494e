"""The official ``openai`` client against the in-process server (fake runtime).

The sync client runs in a worker thread (``trio.to_thread.run_sync``): its async client
works under trio but leaves internal async generators unexhausted after ``[DONE]``,
which trio reports as ResourceWarnings (errors in this suite).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import openai
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import running_server

T = TypeVar("T")
REPLY = "Hello world, this is a tiny reply."


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def make_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=10.0)


async def test_completion_non_streaming_text_and_usage(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            result = await in_thread(functools.partial(
                client.completions.create, model="flare-test", prompt="The quick brown fox",
                max_tokens=5, temperature=0.5, top_p=0.9, seed=11, stop=["zzz"],
                extra_body={"top_k": 7}))
            client.close()
    expected = codec.decode(codec.encode(REPLY)[:5])
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    prompt_tokens = len(codec.encode("The quick brown fox"))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 5)
    assert result.usage.total_tokens == prompt_tokens + 5
    assert result.model == "flare-test" and result.id.startswith("cmpl-")
    request = rt.requests[0]
    assert request.prompt_token_ids == tuple(codec.encode("The quick brown fox"))
    assert request.max_tokens == 5 and request.stop == ("zzz",)
    assert (request.sampling.temperature, request.sampling.top_p) == (0.5, 0.9)
    assert (request.sampling.top_k, request.sampling.seed) == (7, 11)
    assert request.request_id == result.id


async def test_completion_streaming_with_usage(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)

            def run() -> list[openai.types.Completion]:
                stream = client.completions.create(
                    model="flare-test", prompt="Hello", max_tokens=100, stream=True,
                    stream_options={"include_usage": True})
                with stream:
                    return list(stream)

            chunks = await in_thread(run)
            client.close()
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == REPLY  # the reply ends before max_tokens: EOS
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == len(codec.encode(REPLY))
    assert usage.prompt_tokens == len(codec.encode("Hello"))


async def test_chat_non_streaming_and_streaming(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello."}]
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            whole = await in_thread(functools.partial(
                client.chat.completions.create, model="flare-test", messages=messages,
                max_tokens=50))

            def run_stream() -> list[openai.types.chat.ChatCompletionChunk]:
                stream = client.chat.completions.create(
                    model="flare-test", messages=messages, max_tokens=3, stream=True,
                    stream_options={"include_usage": True})
                with stream:
                    return list(stream)

            chunks = await in_thread(run_stream)
            client.close()
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == REPLY
    assert whole.choices[0].finish_reason == "stop"
    prompt_tokens = len(rt.requests[0].prompt_token_ids)
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == len(codec.encode(REPLY))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == codec.decode(codec.encode(REPLY)[:3])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        prompt_tokens, 3)


async def test_api_key_required_when_configured(codec: TinyCodec) -> None:
    from app import AppSettings

    rt = FakeRuntime(codec)
    with trio.fail_after(20):
        async with running_server(rt, AppSettings(api_key="sekrit")) as server:
            good = make_client(server.url, api_key="sekrit")
            bad = make_client(server.url, api_key="wrong")
            result = await in_thread(functools.partial(
                good.completions.create, model="flare-test", prompt="Hi", max_tokens=2))
            try:
                await in_thread(functools.partial(
                    bad.completions.create, model="flare-test", prompt="Hi", max_tokens=2))
            except openai.AuthenticationError as exc:
                error = exc
            good.close()
            bad.close()
    assert result.usage is not None and result.usage.completion_tokens == 2
    assert error.status_code == 401
    assert len(rt.requests) == 1  # the refused request never reached the runtime


async def test_models_retrieve_served_name_and_unknown_is_404(codec: TinyCodec) -> None:
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server:
            client = make_client(server.url)
            model = await in_thread(functools.partial(client.models.retrieve, "flare-test"))
            try:
                await in_thread(functools.partial(client.models.retrieve, "other/model"))
            except openai.NotFoundError as exc:
                missing = exc
            client.close()
    assert (model.id, model.object, model.owned_by) == ("flare-test", "model", "flare")
    assert missing.status_code == 404
    assert isinstance(missing.body, dict) and missing.body["code"] == "model_not_found"
