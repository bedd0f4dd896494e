"""Disconnects cancel the runtime request; shutdown drains with a grace period; faults
after admission reach the client as errors and the server keeps serving."""

from __future__ import annotations

import json
from functools import partial

import structlog
import trio
import trio.testing
from http_fakes import FakeRuntime, TinyCodec
from http_harness import SseReader, client_for, raw_post, receive_until, running_server

COMPLETIONS = "/v1/completions"
STREAM_BODY = {"prompt": "Hello", "max_tokens": 20, "stream": True}


async def test_stream_disconnect_cancels_runtime_request(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, gated=True)
    with trio.fail_after(20), structlog.testing.capture_logs() as logs:
        async with running_server(rt) as server, client_for(server) as client:
            sock = await raw_post(server, COMPLETIONS, STREAM_BODY)
            rt.release(2)
            received = await receive_until(sock, b"data: ")
            assert b" 200 " in received.split(b"\r\n", 1)[0]
            await sock.aclose()  # the client disconnects mid-stream
            await rt.wait_until(lambda: rt.cancelled)
            assert rt.active == 0 and rt.finished == []
            rt.gated = False
            ok = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200
    cancelled = [e for e in logs if e["event"] == "request.cancelled"]
    assert [e["cause"] for e in cancelled] == ["client_disconnected"]
    assert cancelled[0]["request_id"] == rt.cancelled[0]


async def test_non_streaming_disconnect_cancels_runtime_request(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, gated=True)
    with trio.fail_after(20):
        async with running_server(rt) as server:
            async with trio.open_nursery() as nursery:
                async def ask() -> None:
                    async with client_for(server) as client:
                        await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 9})

                nursery.start_soon(ask)
                rt.release(1)
                await rt.wait_until(lambda: rt.tokens_emitted == 1)
                nursery.cancel_scope.cancel()  # the client goes away mid-generation
            await rt.wait_until(lambda: rt.cancelled)
    assert rt.finished == [] and rt.active == 0


async def test_shutdown_lets_streams_finish_within_grace(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, gated=True, reply="one two three")
    with trio.fail_after(20):
        async with (running_server(rt) as server, client_for(server) as client,
                    client.stream("POST", COMPLETIONS, json=STREAM_BODY) as response):
            reader = SseReader(response)
            rt.release(1)
            await reader.next_data()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(server.shutdown, grace_s=15))
                await trio.testing.wait_all_tasks_blocked()
                assert server.service.draining
                refused = await client.post(COMPLETIONS, json={"prompt": "x"})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "shutting_down"
                health = await client.get("/health")
                assert health.status_code == 503
                rt.release(100)
                rest = await reader.rest()
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "stop"
    assert rt.cancelled == [] and len(rt.finished) == 1


async def test_shutdown_past_grace_ends_stream_with_error_event(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, gated=True)
    with trio.fail_after(20):
        async with (running_server(rt) as server, client_for(server) as client,
                    client.stream("POST", COMPLETIONS, json=STREAM_BODY) as response):
            reader = SseReader(response)
            rt.release(1)
            await reader.next_data()
            await server.shutdown(grace_s=0.05)
            rest = await reader.rest()
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert "shut down" in error["message"] and error["type"] == "server_error"
    assert len(rt.cancelled) == 1


async def test_runtime_error_finish_reaches_client(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, fail_after=2)
    with trio.fail_after(20), structlog.testing.capture_logs() as logs:
        async with running_server(rt) as server, client_for(server) as client:
            whole = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 5})
            assert whole.status_code == 500
            assert whole.json()["error"]["message"] == "program fault in decode_b1"
            async with client.stream("POST", COMPLETIONS, json=STREAM_BODY) as response:
                events = await SseReader(response).rest()
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["message"] == "program fault in decode_b1"
            assert len([e for e in events[:-2] if json.loads(e)["choices"][0]["text"]]) == 2
            rt.fail_after = None
            ok = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200
    failed = [e for e in logs if e["event"] == "request.failed"]
    assert len(failed) == 2 and all(e["completion_tokens"] == 2 for e in failed)


async def test_runtime_crash_mid_stream_is_contained(codec: TinyCodec) -> None:
    """An exception escaping the runtime's stream fails that request only."""
    rt = FakeRuntime(codec, crash_after=1)
    with trio.fail_after(20), structlog.testing.capture_logs() as logs:
        async with (running_server(rt) as server, client_for(server) as client,
                    client.stream("POST", COMPLETIONS, json=STREAM_BODY) as response):
            events = await SseReader(response).rest()
            whole = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 5})
            rt.crash_after = None
            ok = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
    assert events[-1] == "[DONE]"
    assert "fake runtime crashed" in json.loads(events[-2])["error"]["message"]
    assert whole.status_code == 500 and "fake runtime crashed" in whole.text
    assert ok.status_code == 200
    assert [e["event"] for e in logs].count("request.failed") == 2


async def test_client_can_read_slowly_without_timeout(codec: TinyCodec) -> None:
    """Back-pressure, not a timeout: the pump waits while the client does not read."""
    rt = FakeRuntime(codec, reply="a b c d e f g h i j k l m n o p q r s t u v w x y z")
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            body = {"prompt": "Hi", "max_tokens": 40, "stream": True}
            async with client.stream("POST", COMPLETIONS, json=body) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                events = await SseReader(response).rest()
    assert events[-1] == "[DONE]" and rt.finished and not rt.cancelled


async def test_dropped_unread_stream_still_cancels_its_request(codec: TinyCodec) -> None:
    """Quart may drop a response whose body it never started (client gone between the
    handler and the body); the stream's finalizer then cancels the pump."""
    import gc

    from actors.public import GenerationRequest
    from app.generation import Inflight, RequestObserver, start_generation
    from app.metrics import AppMetrics

    rt = FakeRuntime(codec, gated=True)
    request = GenerationRequest(prompt_token_ids=(5, 6), max_tokens=4, request_id="cmpl-x")
    inflight = Inflight()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            observer = RequestObserver(AppMetrics(rt.statistics), request_id="cmpl-x",
                                       endpoint="completions", arrived=0.0)
            stream = await start_generation(rt, nursery, inflight, request, observer,
                                            stream=True)
            assert len(inflight) == 1
            del stream
            gc.collect()
            await rt.wait_until(lambda: rt.cancelled == ["cmpl-x"])
            await inflight.wait_empty()
