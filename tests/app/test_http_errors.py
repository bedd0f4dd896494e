"""Bad input never yields a 500, a hang or a crash: every case gets OpenAI's error shape
with the right status, and the same server then serves a good request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server

from app import AppSettings

GOOD_COMPLETION = {"model": "flare-test", "prompt": "Hello", "max_tokens": 3}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    body: Any = None
    raw: bytes | None = None
    path: str = COMPLETIONS
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    param: str | None = None
    code: str | None = None
    max_request_bytes: int = 16_384


PNG_DATA_URL = "data:image/png;base64," + (
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPkOiHHwMDAxMDAwMDAAAALVgD0I4hqmwAAAABJRU5ErkJggg==")
"""A 2x2 RGB PNG."""


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def completion(**overrides: Any) -> dict[str, Any]:
    body = dict(GOOD_COMPLETION)
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not ...}


def chat(messages: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "flare-test", "messages": messages, "max_tokens": 3, **extra}


USER = [{"role": "user", "content": "hi"}]
CASES = [
    Case("malformed_json", 400, raw=b'{"prompt": "hi",'),
    Case("not_an_object", 400, raw=b"[1, 2, 3]"),
    Case("invalid_utf8", 400, raw=b'{"prompt": "\xff\xfe"}'),
    Case("nested_too_deep", 400, raw=b"[" * 5000),
    Case("integer_too_long_for_python", 400, raw=b'{"max_tokens": ' + b"9" * 5000 + b"}"),
    Case("nan_temperature", 400, raw=b'{"prompt": "hi", "temperature": NaN}', param="temperature"),
    Case("max_tokens_string", 400, completion(max_tokens="ten"), param="max_tokens"),
    Case("max_tokens_bool", 400, completion(max_tokens=True), param="max_tokens"),
    Case("max_tokens_fraction", 400, completion(max_tokens=2.5), param="max_tokens"),
    Case("max_tokens_huge", 400, completion(max_tokens=10**30), param="max_tokens"),
    Case("max_tokens_negative", 400, completion(max_tokens=-1), param="max_tokens"),
    Case("max_tokens_zero_without_echo", 400, completion(max_tokens=0), param="max_tokens"),
    Case("temperature_integer_beyond_float", 400,
         raw=b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", param="temperature"),
    Case("temperature_out_of_range", 400, completion(temperature=5), param="temperature"),
    Case("top_p_zero", 400, completion(top_p=0), param="top_p"),
    Case("top_k_string", 400, completion(top_k="many"), param="top_k"),
    Case("seed_string", 400, completion(seed="abc"), param="seed"),
    Case("stream_not_bool", 400, completion(stream="yes"), param="stream"),
    Case("stream_options_without_stream", 400, completion(stream_options={"include_usage": True}),
         param="stream_options"),
    Case("too_many_stops", 400, completion(stop=["a", "b", "c", "d", "e"]), param="stop"),
    Case("stop_not_string", 400, completion(stop=[1]), param="stop"),
    Case("empty_stop", 400, completion(stop=""), param="stop"),
    Case("prompt_missing", 400, completion(prompt=...), param="prompt"),
    Case("prompt_object", 400, completion(prompt={"text": "hi"}), param="prompt"),
    Case("prompt_batch_mixed", 400, completion(prompt=["a", [1, 2]]), param="prompt"),
    Case("prompt_batch_empty", 400, completion(prompt=[]), param="prompt"),
    Case("prompt_empty", 400, completion(prompt=""), param="prompt"),
    Case("token_id_beyond_vocab", 400, completion(prompt=[1, 2, 10**6]), param="prompt"),
    Case("token_id_negative", 400, completion(prompt=[1, -2]), param="prompt"),
    Case("unknown_model", 404, completion(model="gpt-9"), param="model", code="model_not_found"),
    Case("n_zero", 400, completion(n=0), param="n"),
    Case("choices_beyond_limit", 400, completion(prompt=["a"] * 3, n=50), param="n"),
    Case("unknown_field", 400, completion(temprature=0.5), param="temprature"),
    Case("priority", 400, completion(priority=3), param="priority"),
    Case("stream_options_unknown", 400, completion(stream=True,
                                                   stream_options={"include_usge": True}),
         param="stream_options"),
    Case("best_of", 400, completion(best_of=3), param="best_of"),
    Case("logprobs_beyond_twenty", 400, completion(logprobs=21), param="logprobs"),
    Case("chat_top_logprobs_beyond_twenty", 400, chat(USER, logprobs=True, top_logprobs=21),
         path=CHAT, param="top_logprobs"),
    Case("chat_top_logprobs_without_logprobs", 400, chat(USER, top_logprobs=2), path=CHAT,
         param="top_logprobs"),
    Case("penalty_out_of_range", 400, completion(presence_penalty=2.5),
         param="presence_penalty"),
    Case("suffix", 400, completion(suffix="end"), param="suffix"),
    Case("prompt_beyond_context", 400, completion(prompt=[5] * 300),
         code="context_length_exceeded"),
    Case("prompt_plus_max_tokens_beyond_context", 400, completion(prompt=[5] * 200,
                                                                  max_tokens=100),
         code="context_length_exceeded"),
    Case("chat_messages_missing", 400, {"model": "flare-test"}, path=CHAT, param="messages"),
    Case("chat_messages_empty", 400, chat([]), path=CHAT, param="messages"),
    Case("chat_message_not_object", 400, chat(["hi"]), path=CHAT, param="messages"),
    Case("chat_bad_role", 400, chat([{"role": "wizard", "content": "hi"}]), path=CHAT,
         param="messages"),
    Case("chat_image_url_remote", 400, chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), path=CHAT,
         param="messages[0].content[0].image_url"),
    Case("chat_image_truncated_base64", 400, chat([{"role": "user", "content": [
        {"type": "text", "text": "see"}, image_part(PNG_DATA_URL[:-7])]}]), path=CHAT,
         param="messages[0].content[1].image_url"),
    Case("chat_image_not_an_image", 400, chat([{"role": "user", "content": [
        image_part("data:image/png;base64,aGVsbG8gd29ybGQ=")]}]), path=CHAT,
         param="messages[0].content[0].image_url"),
    Case("chat_too_many_images", 400, chat([{"role": "user", "content": [
        image_part(PNG_DATA_URL)] * 5}]), path=CHAT, param="messages[0].content[4].image_url"),
    Case("chat_image_on_a_text_model", 400, chat([{"role": "user", "content": [
        image_part(PNG_DATA_URL)]}]), path=CHAT, param="messages[0].content[0].image_url"),
    Case("chat_content_number", 400, chat([{"role": "user", "content": 5}]), path=CHAT,
         param="messages"),
    Case("chat_template_rejects", 400, chat([{"role": "assistant", "content": "hi"}]),
         path=CHAT, param="messages"),
    Case("chat_too_many_messages", 400, chat(USER * 3000), path=CHAT, param="messages",
         max_request_bytes=1 << 20),
    Case("chat_tools", 400, chat(USER, tools=[{"type": "function"}]), path=CHAT, param="tools"),
    Case("chat_n_beyond_limit", 400, chat(USER, n=500), path=CHAT, param="n"),
    Case("chat_legacy_functions", 400, chat(USER, functions=[{"name": "f"}]), path=CHAT,
         param="functions"),
    Case("chat_unknown_model", 404, {**chat(USER), "model": "nope"}, path=CHAT,
         code="model_not_found"),
    Case("chat_beyond_context", 400, chat([{"role": "user", "content": "fox " * 400}]),
         path=CHAT, code="context_length_exceeded"),
    Case("body_too_large", 413, completion(prompt="x" * 20_000), code="request_too_large"),
    Case("unknown_route", 404, {}, path="/v1/engines"),
    Case("wrong_method", 405, None, path=COMPLETIONS, method="GET"),
]


def assert_openai_error(response: httpx.Response, case: Case) -> None:
    assert response.status_code == case.status, response.text
    body = response.json()
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert set(error) == {"message", "type", "param", "code"}
    if case.param is not None:
        assert error["param"] == case.param
    if case.code is not None:
        assert error["code"] == case.code


async def assert_still_serves(client: httpx.AsyncClient, **headers: str) -> None:
    response = await client.post(COMPLETIONS, json=GOOD_COMPLETION, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_input_gets_openai_error_then_server_still_serves(
        codec: TinyCodec, case: Case) -> None:
    rt = FakeRuntime(codec, max_context=256)
    settings = AppSettings(max_request_bytes=case.max_request_bytes)
    with trio.fail_after(20):
        async with running_server(rt, settings) as server, client_for(server) as client:
            if case.raw is not None:
                content = case.raw
            else:
                content = b"" if case.body is None else json.dumps(case.body).encode()
            response = await client.request(case.method, case.path, content=content,
                                            headers={"Content-Type": "application/json"})
            assert_openai_error(response, case)
            assert rt.requests == []  # nothing malformed reached the runtime
            await assert_still_serves(client)


async def test_body_too_large_without_content_length_is_413(codec: TinyCodec) -> None:
    """A chunked body (no Content-Length) is cut off at the limit too."""
    rt = FakeRuntime(codec)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    with trio.fail_after(20):
        async with running_server(rt, AppSettings(max_request_bytes=4096)) as server, \
                client_for(server) as client:
            response = await client.post(COMPLETIONS, content=chunks(),
                                         headers={"Content-Type": "application/json"})
            assert_openai_error(response, Case("chunked", 413))
            # The unread rest of the body makes the connection unusable: the server says
            # so, and the client's next request goes over a fresh connection.
            assert response.headers.get("connection") == "close"
            await assert_still_serves(client)


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic c2Vrcml0", "Bearer", "bearer sekrit2"])
async def test_missing_or_wrong_api_key_is_401(codec: TinyCodec, header: str | None) -> None:
    rt = FakeRuntime(codec)
    headers = {} if header is None else {"Authorization": header}
    with trio.fail_after(20):
        async with running_server(rt, AppSettings(api_key="sekrit")) as server, \
                client_for(server) as client:
            response = await client.post(COMPLETIONS, json=GOOD_COMPLETION, headers=headers)
            assert_openai_error(response, Case("auth", 401, code="invalid_api_key"))
            assert response.headers["WWW-Authenticate"] == "Bearer"
            health = await client.get("/health")  # not behind the key
            assert health.status_code == 200
            await assert_still_serves(client, Authorization="Bearer sekrit")
    assert len(rt.requests) == 1


async def test_full_queue_is_429_with_retry_after(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, queue_full=True, retry_after_s=7)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            for path, body in ((COMPLETIONS, GOOD_COMPLETION),
                               (CHAT, chat(USER, stream=True))):
                response = await client.post(path, json=body)
                assert_openai_error(response, Case("queue", 429, code="queue_full"))
                assert response.headers["Retry-After"] == "7"
            rt.queue_full = False
            await assert_still_serves(client)
            metrics = (await client.get("/metrics")).text
    assert 'flare_http_errors_total{model_name="flare-test",status="429"} 2.0' in metrics


async def test_runtime_refusal_is_400(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, invalid=True)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            response = await client.post(COMPLETIONS, json=GOOD_COMPLETION)
            assert_openai_error(response, Case("invalid", 400))
            assert "refuses" in response.json()["error"]["message"]
            rt.invalid = False
            await assert_still_serves(client)
