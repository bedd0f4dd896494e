"""``max_tokens`` with ``max_completion_tokens`` on chat, and the field a context-length
error names on each route, through the official client."""

from __future__ import annotations

import functools

import openai
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import running_server
from test_http_openai_client import in_thread, make_client

USER = [{"role": "user", "content": "hi"}]


async def test_both_max_token_fields_must_agree(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply="Hello world again")
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            same = await in_thread(functools.partial(
                client.chat.completions.create, model="flare-test", messages=USER,
                max_tokens=2, max_completion_tokens=2))
            try:
                await in_thread(functools.partial(
                    client.chat.completions.create, model="flare-test", messages=USER,
                    max_tokens=2, max_completion_tokens=3))
            except openai.BadRequestError as exc:
                refused = exc
            client.close()
    assert same.usage is not None and same.usage.completion_tokens == 2
    assert rt.requests[0].max_tokens == 2 and len(rt.requests) == 1
    assert isinstance(refused.body, dict) and refused.body["param"] == "max_completion_tokens"


async def test_context_length_error_names_prompt_on_completions(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec)
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            errors = []
            for call in (
                    functools.partial(client.completions.create, model="flare-test",
                                      prompt="Hello", max_tokens=256),
                    functools.partial(client.chat.completions.create, model="flare-test",
                                      messages=USER, max_tokens=256)):
                try:
                    await in_thread(call)
                except openai.BadRequestError as exc:
                    errors.append(exc.body)
            client.close()
    assert [(e["code"], e["param"]) for e in errors if isinstance(e, dict)] == [
        ("context_length_exceeded", "prompt"), ("context_length_exceeded", "messages")]
