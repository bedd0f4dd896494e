"""The logit-processing sampling fields through the official client: OpenAI's
``presence_penalty``, ``frequency_penalty`` and ``logit_bias``, and vLLM's extra
fields ``repetition_penalty``, ``min_p``, ``min_tokens`` and ``stop_token_ids``, on
completions and chat; each reaches the runtime as sent, and each invalid value is a
400 naming its field (the runtime never sees the request)."""

from __future__ import annotations

import functools
from typing import Any

import openai
import pytest
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import running_server
from test_http_openai_client import in_thread, make_client

USER = [{"role": "user", "content": "hi"}]


def create(client: openai.OpenAI, route: str, standard: dict[str, Any],
           extra: dict[str, Any]) -> Any:
    if route == "chat":
        return client.chat.completions.create(model="flare-test", messages=USER,  # type: ignore[call-overload]
                                              max_tokens=4, extra_body=extra, **standard)
    return client.completions.create(model="flare-test", prompt="Hello", max_tokens=4,  # type: ignore[call-overload]
                                     extra_body=extra, **standard)


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_every_field_reaches_the_runtime(codec: TinyCodec, route: str) -> None:
    rt = FakeRuntime(codec)
    standard = {"presence_penalty": 0.5, "frequency_penalty": -1.25,
                "logit_bias": {"17": 100, "5": -100, "42": 2.5}}
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 2,
             "stop_token_ids": [7, 9, 7]}
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            await in_thread(functools.partial(create, client, route, standard, extra))
            await in_thread(functools.partial(create, client, route, {}, {}))
            client.close()
    s, default = rt.requests[0].sampling, rt.requests[1].sampling
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.25)
    assert s.logit_bias == ((5, -100.0), (17, 100.0), (42, 2.5))
    assert (s.repetition_penalty, s.min_p, s.min_tokens) == (1.3, 0.05, 2)
    assert s.stop_token_ids == (7, 9)
    assert not default.processes_logits and default.stop_token_ids == ()


INVALID = [
    ("presence_penalty", 2.5, True), ("presence_penalty", "high", True),
    ("frequency_penalty", -3, True),
    ("logit_bias", {"17": 101}, True), ("logit_bias", {"abc": 1}, True),
    ("logit_bias", {"-3": 1}, True), ("logit_bias", {"100000": 1}, True),
    ("logit_bias", {str(i): 1 for i in range(301)}, True), ("logit_bias", [1, 2], True),
    ("repetition_penalty", 0, False), ("repetition_penalty", -1.5, False),
    ("min_p", 1.5, False), ("min_p", -0.1, False),
    ("min_tokens", -1, False), ("min_tokens", 5, False), ("min_tokens", 1.5, False),
    ("stop_token_ids", [1, -2], False), ("stop_token_ids", [100000], False),
    ("stop_token_ids", "7", False), ("stop_token_ids", [True], False),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_invalid_values_are_400_naming_the_field(codec: TinyCodec, route: str) -> None:
    """Ranges are vLLM's; token ids must lie inside the vocabulary; ``min_tokens`` may not
    exceed ``max_tokens`` (4 here)."""
    rt = FakeRuntime(codec)
    params = []
    with trio.fail_after(30):
        async with running_server(rt) as server:
            client = make_client(server.url)
            for field, value, standard in INVALID:
                body = {field: value}
                call = functools.partial(create, client, route, body if standard else {},
                                         {} if standard else body)
                try:
                    await in_thread(call)
                except openai.BadRequestError as exc:
                    assert isinstance(exc.body, dict)
                    params.append(exc.body["param"])
                else:
                    params.append(f"accepted {field}={value!r}")
            client.close()
    assert params == [field for field, _, _ in INVALID]
    assert rt.requests == []
