"""Every input path is total: text that is not valid Unicode and booleans where numbers
belong are 400s naming the field (never a 500), and every error status the server
answers, its own or hypercorn's, carries OpenAI's JSON error body."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import hypercorn.trio
import pytest
import structlog
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, receive_until, running_server
from hypercorn.config import Config
from test_http_errors import (
    CHAT,
    COMPLETIONS,
    Case,
    assert_openai_error,
    assert_still_serves,
    chat,
    completion,
)

from app.error_handlers import install_protocol_error_bodies

LONE = "\ud800"
SURROGATE_CASES = [
    Case("prompt", 400, completion(prompt=LONE), param="prompt"),
    Case("prompt_after_text", 400, completion(prompt="Hello " + "\udfff"), param="prompt"),
    Case("prompt_in_list", 400, completion(prompt=[LONE]), param="prompt"),
    Case("stop", 400, completion(stop=["ok", LONE]), param="stop"),
    Case("user", 400, completion(user=LONE), param="user"),
    Case("model", 400, completion(model=LONE), param="model"),
    Case("unknown_field_value", 400, completion(extension={"note": LONE}), param="extension"),
    Case("field_name", 400, completion(**{LONE: 1})),
    Case("chat_content", 400, chat([{"role": "user", "content": LONE}]), path=CHAT,
         param="messages"),
    Case("chat_text_part", 400, chat([{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]), path=CHAT, param="messages"),
    Case("chat_name", 400, chat([{"role": "user", "content": "hi", "name": LONE}]),
         path=CHAT, param="messages"),
    Case("chat_stop", 400, chat([{"role": "user", "content": "hi"}], stop=LONE), path=CHAT,
         param="stop"),
]
BOOLEAN_CASES = [
    Case(f"{name}_{value}", 400, completion(**{name: value}), path=path, param=name)
    for name, value in (("n", True), ("best_of", True), ("presence_penalty", False),
                        ("frequency_penalty", False), ("logprobs", True), ("seed", True),
                        ("top_k", False), ("temperature", True))
    for path in (COMPLETIONS,)
] + [Case("chat_n_true", 400, chat([{"role": "user", "content": "hi"}], n=True), path=CHAT,
          param="n")]


@pytest.mark.parametrize("case", SURROGATE_CASES + BOOLEAN_CASES,
                         ids=[c.name for c in SURROGATE_CASES + BOOLEAN_CASES])
async def test_invalid_unicode_and_booleans_are_400_naming_the_field(
        codec: TinyCodec, case: Case) -> None:
    rt = FakeRuntime(codec)
    # json.dumps escapes a lone surrogate as \ud800, exactly what a client sends.
    content = json.dumps(case.body).encode()
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            response = await client.post(case.path, content=content,
                                         headers={"Content-Type": "application/json"})
            assert_openai_error(response, case)
            assert rt.requests == []
            await assert_still_serves(client)


async def test_neutral_values_are_still_accepted(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec)
    body = completion(n=1, best_of=1.0, presence_penalty=0.0, frequency_penalty=0,
                      prompt="caf\u00e9 \U0001f600")  # a surrogate *pair* is valid Unicode
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            response = await client.post(COMPLETIONS, content=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            assert response.status_code == 200, response.text
    assert len(rt.requests) == 1


async def test_405_keeps_allow_header_and_json_body(codec: TinyCodec) -> None:
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server, client_for(server) as client:
            response = await client.delete(COMPLETIONS)
            assert_openai_error(response, Case("method", 405, code="method_not_allowed"))
            assert "POST" in response.headers["Allow"]
            response = await client.get("/v1/nothing-here")
            assert_openai_error(response, Case("route", 404, code="not_found"))
            assert response.headers["Content-Type"] == "application/json"


async def _raw_exchange(port: int, request: bytes) -> tuple[str, dict[str, str], bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = await receive_until(stream, b"\r\n\r\n")
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(body) < int(headers.get("content-length", "0")):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            body += chunk
    return lines[0], headers, body


def _assert_json_error(status_line: str, headers: dict[str, str], body: bytes, status: int,
                       code: str | None) -> None:
    assert status_line.split(" ")[1] == str(status), status_line
    assert headers["content-type"] == "application/json"
    response = httpx.Response(status, content=body)
    assert_openai_error(response, Case("protocol", status, code=code))


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431,
     "request_header_fields_too_large"),
    (b"NOT A REQUEST\r\n\r\n", 400, "bad_request"),
], ids=["header_fields_too_large", "malformed_request_line"])
async def test_protocol_errors_from_hypercorn_have_json_bodies(
        codec: TinyCodec, request_bytes: bytes, status: int, code: str) -> None:
    """hypercorn answers these before the app sees a request."""
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server:
            status_line, headers, body = await _raw_exchange(server.port, request_bytes)
            _assert_json_error(status_line, headers, body, status, code)
            assert headers["connection"] == "close"
            async with client_for(server) as client:
                await assert_still_serves(client)


async def test_app_ending_without_an_answer_is_a_json_500() -> None:
    """hypercorn's own 500 (an application that returned without responding)."""
    install_protocol_error_bodies()

    async def silent_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn.trio.serve, silent_app, config))
            port = int(binds[0].rsplit(":", 1)[1])
            status_line, headers, body = await _raw_exchange(
                port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            _assert_json_error(status_line, headers, body, 500, "internal_error")
            nursery.cancel_scope.cancel()


async def test_refusals_while_draining_are_not_logged_as_errors(codec: TinyCodec) -> None:
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server, client_for(server) as client:
            server.service.draining = True
            with structlog.testing.capture_logs() as logs:
                for path, body in ((COMPLETIONS, completion()),
                                   (CHAT, chat([{"role": "user", "content": "hi"}]))):
                    response = await client.post(path, json=body)
                    assert_openai_error(response, Case("draining", 503, code="shutting_down"))
    refused = [entry for entry in logs if entry["event"] == "http.refused"]
    assert len(refused) == 2
    assert {entry["log_level"] for entry in refused} == {"info"}
    assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")]
