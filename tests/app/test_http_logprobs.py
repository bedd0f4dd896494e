"""Logprobs in OpenAI's shapes through the official ``openai`` client (fake runtime).

Completions ``logprobs: k`` gives one ``{token: logprob}`` dict per token (its k
alternatives best first, plus the token itself when it is not among them) and ``null``
for the first echoed prompt token; ``logprobs: 0`` gives ``top_logprobs: null``. Chat
``logprobs`` + ``top_logprobs: k`` gives ``content`` entries with exactly k
alternatives. Streaming and not agree; echo with ``max_tokens: 0`` scores the prompt and
generates nothing. The values themselves are checked on the real model in
``tests/server/test_openai_logprobs.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import openai
import trio
from http_fakes import FakeRuntime, TinyCodec, fake_alternatives
from http_harness import running_server
from test_http_openai_client import in_thread, make_client

REPLY = "Hello world, this is a tiny reply."
PROMPT = "The quick brown fox"


def expected_dict(codec: TinyCodec, k: int, token_text: str, logprob: float) -> dict[str, float]:
    entries = {codec.decode([t]): lp for t, lp in fake_alternatives(k)}
    entries.setdefault(token_text, logprob)
    return entries


async def _completions(codec: TinyCodec, **kwargs: Any) -> tuple[FakeRuntime, Any, list[Any]]:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            create = functools.partial(client.completions.create, model="flare-test",
                                       prompt=PROMPT, **kwargs)
            whole = await in_thread(create)

            def streamed() -> list[Any]:
                with create(stream=True) as stream:
                    return list(stream)

            chunks = await in_thread(streamed)
            client.close()
    return rt, whole, chunks


async def test_completions_logprobs_k_gives_k_alternatives_and_the_token(
        codec: TinyCodec) -> None:
    rt, whole, chunks = await _completions(codec, max_tokens=4, logprobs=3)
    assert rt.requests[0].logprobs and rt.requests[0].top_logprobs == 3
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == 4 and lp.token_logprobs == [-0.25] * 4
    for text, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert top == expected_dict(codec, 3, text, -0.25)
        assert list(top.values())[:3] == sorted(list(top.values())[:3], reverse=True)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs


async def test_completions_logprobs_zero_gives_the_sampled_logprob_only(
        codec: TinyCodec) -> None:
    rt, whole, chunks = await _completions(codec, max_tokens=3, logprobs=0)
    assert rt.requests[0].logprobs and rt.requests[0].top_logprobs == 0
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == [-0.25] * 3 and lp.top_logprobs is None
    assert all(c.choices[0].logprobs.top_logprobs is None
               for c in chunks if c.choices and c.choices[0].logprobs)


async def test_echo_max_tokens_zero_scores_the_prompt_with_alternatives(
        codec: TinyCodec) -> None:
    rt, whole, chunks = await _completions(codec, max_tokens=0, echo=True, logprobs=2)
    request = rt.requests[0]
    assert request.prompt_logprobs and request.max_tokens == 0 and request.top_logprobs == 2
    choice = whole.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 0
    prompt_ids = codec.encode(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for text, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:],
                                  strict=True):
        assert top == expected_dict(codec, 2, text, logprob)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs


async def test_echo_max_tokens_zero_without_logprobs_echoes_the_prompt(
        codec: TinyCodec) -> None:
    rt, whole, _ = await _completions(codec, max_tokens=0, echo=True)
    assert rt.requests[0].prompt_logprobs and rt.requests[0].max_tokens == 0
    assert whole.choices[0].text == PROMPT and whole.choices[0].logprobs is None
    assert whole.usage.completion_tokens == 0


async def test_chat_top_logprobs_k_streaming_and_not(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            create = functools.partial(
                client.chat.completions.create, model="flare-test",
                messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True)
            whole = await in_thread(functools.partial(create, top_logprobs=4))
            none = await in_thread(create)

            def streamed() -> list[Any]:
                with create(top_logprobs=4, stream=True) as stream:
                    return list(stream)

            chunks = await in_thread(streamed)
            client.close()
    assert [r.top_logprobs for r in rt.requests] == [4, 0, 4]
    content = whole.choices[0].logprobs.content
    assert len(content) == 3
    expected = [(codec.decode([t]), lp) for t, lp in fake_alternatives(4)]
    for entry in content:
        assert entry.logprob == -0.25 and entry.bytes == list(entry.token.encode("utf-8"))
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == expected
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in entry.top_logprobs)
    assert all(entry.top_logprobs == [] for entry in none.choices[0].logprobs.content)
    streamed_entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed_entries] == [e.model_dump() for e in content]


async def test_out_of_range_alternatives_are_a_400_naming_the_field(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            errors: list[openai.BadRequestError] = []
            calls = [
                functools.partial(client.completions.create, model="flare-test", prompt=PROMPT,
                                  max_tokens=2, logprobs=21),
                functools.partial(client.chat.completions.create, model="flare-test",
                                  messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  logprobs=True, top_logprobs=21),
                functools.partial(client.completions.create, model="flare-test", prompt=PROMPT,
                                  max_tokens=0, logprobs=1),
            ]
            for call in calls:
                try:
                    await in_thread(call)
                except openai.BadRequestError as exc:
                    errors.append(exc)
            client.close()
    assert [e.body["param"] for e in errors] == ["logprobs", "top_logprobs", "max_tokens"]  # type: ignore[index]
    assert rt.requests == []
