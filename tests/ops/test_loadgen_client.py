"""The open-loop client against a tiny in-process OpenAI-compatible SSE server on loopback.

Covers the load benchmark: streamed chunks are timed and counted, client tags are
sent, completions and chat routes both parse, HTTP errors are recorded, fixed concurrency
is a closed loop, and the time limit stops the run by itself. The fake server paces tokens
with ``trio.sleep`` (its behaviour); readiness comes from ``nursery.start``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio

from ops.loadgen.client import Progress, Target, build_body, chunk_text, run_load
from ops.loadgen.prompts import WordPrompts
from ops.loadgen.workload import RequestPlan

TOKEN_PACE_S = 0.01
SLOW_PACE_S = 0.05
SERVED_MODEL = "fake-model"
TEST_DEADLINE_S = 15


class FakeOpenAI:
    """Raw ASGI app: streams ``max_tokens`` one-word chunks, ``TOKEN_PACE_S`` apart.

    A body with ``"stream": false`` gets one JSON answer after ``max_tokens`` paces.
    The model name ``"busy"`` gets a 429, ``"broken"`` fails after one token with an SSE
    error event, and ``"slow"`` paces at ``SLOW_PACE_S`` per token.
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/v1/models":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": json.dumps({"data": [{"id": SERVED_MODEL}]}).encode(),
                }
            )
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        self.bodies.append(body)
        if body["model"] == "busy":
            await send(
                {
                    "type": "http.response.start",
                    "status": 429,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"error": "queue full"}'})
            return
        chat = scope["path"] == "/v1/chat/completions"
        pace = SLOW_PACE_S if body["model"] == "slow" else TOKEN_PACE_S
        if body.get("stream") is False:
            await self._answer_whole(send, body, pace)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )

        async def event(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {data}\n\n".encode(),
                    "more_body": True,
                }
            )

        await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
        n = body["max_tokens"]
        if body["model"] == "broken":
            await event({"choices": [{"index": 0, "text": " w0", "finish_reason": None}]})
            await event({"error": {"message": "device lost", "type": "server_error"}})
            await event("{not json")  # must not crash the client either
            await event("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        for i in range(n):
            await trio.sleep(pace)
            word = f" w{i}"
            finish = "length" if i == n - 1 else None
            choice = (
                {"index": 0, "delta": {"content": word}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": word, "finish_reason": finish}
            )
            await event({"choices": [choice]})
        await event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


    async def _answer_whole(self, send: Any, body: dict[str, Any], pace: float) -> None:
        """A non-streaming completion: ``max_tokens`` words after as many paces."""
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        n = body["max_tokens"]
        await trio.sleep(pace * n)
        self.in_flight -= 1
        answer = {"choices": [{"index": 0, "text": "".join(f" w{i}" for i in range(n)),
                               "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 7, "completion_tokens": n}}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


@asynccontextmanager
async def serving(app: FakeOpenAI) -> AsyncIterator[str]:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 0.5
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait)
        )
        try:
            yield binds[0]
        finally:
            stop.set()


def plan(index: int, *, client: str = "a", at: float = 0.0, out: int = 4) -> RequestPlan:
    return RequestPlan(index=index, client=client, arrival_s=at, prompt_tokens=5, output_tokens=out)


async def test_stream_chunks_are_timed_and_counted() -> None:
    app = FakeOpenAI()
    plans = [plan(0, client="a"), plan(1, client="b", at=0.02), plan(2, client="a", at=0.04)]
    with trio.fail_after(TEST_DEADLINE_S):
        async with serving(app) as url:
            result = await run_load(Target(base_url=url), plans, WordPrompts(), time_limit_s=10)
    assert not result.hit_time_limit
    assert [r.status for r in result.records] == ["ok"] * 3
    for record, p in zip(result.records, plans, strict=True):
        assert record.client == p.client
        assert len(record.chunk_times_s) == 4
        assert record.output_tokens == 4
        assert record.prompt_tokens == 7  # from the server's usage report
        assert record.finish_reason == "length"
        assert record.sent_s >= p.arrival_s
        assert list(record.chunk_times_s) == sorted(record.chunk_times_s)
        # The server slept before each token, so the last one cannot arrive sooner.
        assert record.chunk_times_s[-1] - record.sent_s >= 4 * TOKEN_PACE_S
        assert record.finished_s is not None and record.finished_s >= record.chunk_times_s[-1]
        assert record.ttft_s is not None and record.ttft_s >= TOKEN_PACE_S
    assert result.duration_s >= max(r.finished_s or 0 for r in result.records)
    # Arrival order at the server follows connection set-up, not the 20 ms plan spacing.
    assert sorted(b["user"] for b in app.bodies) == ["a", "a", "b"]
    assert all(b["stream"] is True and b["max_tokens"] == 4 for b in app.bodies)
    assert result.model == SERVED_MODEL  # discovered from /v1/models
    assert all(b["model"] == SERVED_MODEL for b in app.bodies)
    assert all(len(b["prompt"].split()) == 5 for b in app.bodies)


async def test_chat_route_and_usage_rescaled_chunks() -> None:
    app = FakeOpenAI()
    with trio.fail_after(TEST_DEADLINE_S):
        async with serving(app) as url:
            result = await run_load(
                Target(base_url=url, endpoint="chat", ignore_eos=True),
                [plan(0, out=3)],
                WordPrompts(),
                time_limit_s=10,
            )
    (record,) = result.records
    assert record.status == "ok" and len(record.chunk_tokens) == 3
    assert sum(record.chunk_tokens) == 3
    body = app.bodies[0]
    assert body["messages"][0]["role"] == "user" and body["ignore_eos"] is True


async def test_http_errors_are_recorded_not_raised() -> None:
    app = FakeOpenAI()
    with trio.fail_after(TEST_DEADLINE_S):
        async with serving(app) as url:
            result = await run_load(
                Target(base_url=url, model="busy"), [plan(0)], WordPrompts(), time_limit_s=10
            )
    (record,) = result.records
    assert record.status == "error" and record.http_status == 429
    assert record.error is not None and "queue full" in record.error
    assert record.chunk_times_s == ()


async def test_an_error_event_mid_stream_fails_the_request_and_keeps_its_chunks() -> None:
    app = FakeOpenAI()
    with trio.fail_after(TEST_DEADLINE_S):
        async with serving(app) as url:
            result = await run_load(
                Target(base_url=url, model="broken"), [plan(0)], WordPrompts(), time_limit_s=10
            )
    (record,) = result.records
    assert record.status == "error" and record.http_status == 200
    assert record.error is not None and "device lost" in record.error
    assert len(record.chunk_times_s) == 1 and record.finished_s is not None


async def test_connection_refused_is_an_error_record() -> None:
    # Find a free port by binding and closing: nothing listens there afterwards.
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with trio.fail_after(TEST_DEADLINE_S):
        result = await run_load(
            Target(base_url=f"http://127.0.0.1:{port}"), [plan(0)], WordPrompts(), time_limit_s=10
        )
    assert result.records[0].status == "error"
    assert "Connect" in (result.records[0].error or "")


async def test_fixed_concurrency_is_a_closed_loop() -> None:
    app = FakeOpenAI()
    plans = [plan(i, out=2) for i in range(3)]
    with trio.fail_after(TEST_DEADLINE_S):
        async with serving(app) as url:
            result = await run_load(
                Target(base_url=url), plans, WordPrompts(), time_limit_s=10, concurrency=1
            )
    records = result.records
    assert [r.status for r in records] == ["ok"] * 3
    for earlier, later in itertools.pairwise(records):
        assert earlier.finished_s is not None and later.sent_s >= earlier.finished_s


async def test_time_limit_stops_the_run_and_cancels_in_flight_requests() -> None:
    app = FakeOpenAI()
    # Request 0 needs 5 s (100 slow tokens); request 1 is planned after the limit. The
    # limit leaves a loaded machine time to send the request and stream some of it.
    plans = [plan(0, out=100), plan(1, at=30.0)]
    snapshots: list[Progress] = []
    with trio.fail_after(TEST_DEADLINE_S):
        async with serving(app) as url:
            result = await run_load(
                Target(base_url=url, model="slow"),
                plans,
                WordPrompts(),
                time_limit_s=2.0,
                on_progress=snapshots.append,
                progress_interval_s=0.2,
            )
    assert result.hit_time_limit
    assert result.planned == 2
    (record,) = result.records  # request 1 was never sent
    assert record.status == "cancelled" and record.finished_s is None
    assert 1 <= len(record.chunk_times_s) < 100  # what arrived before the limit is kept
    assert 2.0 <= result.duration_s < 100 * SLOW_PACE_S
    # Progress snapshots came while the stream was open: one request sent, none finished.
    assert snapshots and all(s.planned == 2 and s.finished == 0 for s in snapshots)
    assert snapshots[-1].sent == 1
    chunks = [s.output_chunks for s in snapshots]
    assert chunks == sorted(chunks)


def test_chunk_text_reads_both_routes_and_ignores_malformed_choices() -> None:
    assert chunk_text({"choices": [{"text": "ab", "finish_reason": None}]}, "completions") == (
        "ab",
        None,
    )
    assert chunk_text(
        {"choices": [{"delta": {"content": "c"}, "finish_reason": "stop"}]}, "chat"
    ) == ("c", "stop")
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, "chat") == ("", None)
    assert chunk_text({"choices": ["junk", {"delta": 3}], "usage": {}}, "chat") == ("", None)
    assert chunk_text({"choices": None}, "completions") == ("", None)


def test_request_bodies_carry_the_plan() -> None:
    body = build_body(
        Target(base_url="http://127.0.0.1:1", model="m", temperature=0.0, extra_body={"top_k": 5}),
        plan(3, client="z", out=9),
        "hello",
    )
    assert body == {
        "model": "m",
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "z",
        "prompt": "hello",
        "temperature": 0.0,
        "top_k": 5,
    }
