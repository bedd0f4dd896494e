"""An incoming ``X-Request-Id`` names the request (``cmpl-<id>``, ``chatcmpl-<id>``) and is
echoed back; without one the generated id is echoed; a malformed one is a 400."""

from __future__ import annotations

import functools

import httpx
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server
from test_http_openai_client import in_thread, make_client

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_client_id_names_the_request_and_is_echoed(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply="Hello there")
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = make_client(server.url)
            raw = await in_thread(functools.partial(
                client.completions.with_raw_response.create, model="flare-test",
                prompt="Hello", max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}))

            def stream_chat() -> tuple[str, list[str]]:
                chat = client.chat.completions.with_raw_response.create(
                    model="flare-test", stream=True, max_tokens=2,
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"X-Request-Id": "trace-43"})
                return chat.headers["X-Request-Id"], [c.id for c in chat.parse()]

            echoed, chunk_ids = await in_thread(stream_chat)
            client.close()
    assert raw.headers["X-Request-Id"] == "trace-42"
    assert raw.parse().id == "cmpl-trace-42"
    assert echoed == "trace-43"
    assert chunk_ids and all(i == "chatcmpl-trace-43" for i in chunk_ids)
    assert [r.request_id for r in rt.requests] == ["cmpl-trace-42", "chatcmpl-trace-43"]


async def test_without_a_client_id_the_generated_one_is_echoed(codec: TinyCodec) -> None:
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server, client_for(server) as client:
            response = await client.post("/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 200
    assert response.headers["X-Request-Id"] == response.json()["id"]
    assert response.json()["id"].startswith("chatcmpl-")


async def test_malformed_client_ids_are_400_naming_the_header(codec: TinyCodec) -> None:
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server, client_for(server) as client:
            answers = [await client.post(path, json=body, headers={"X-Request-Id": bad})
                       for bad in (b"x" * 129, b"a\tb", "caf\u00e9".encode())
                       for path, body in (("/v1/chat/completions", CHAT_BODY),
                                          ("/v1/completions", {"prompt": "hi"}))]
            longest = await client.post("/v1/completions", json={"prompt": "hi"},
                                        headers={"X-Request-Id": "x" * 128})
    for response in answers:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "X-Request-Id"
    assert isinstance(longest, httpx.Response) and longest.status_code == 200
    assert longest.json()["id"] == "cmpl-" + "x" * 128
