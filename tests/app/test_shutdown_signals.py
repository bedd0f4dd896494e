"""Signals during shutdown: the first SIGINT/SIGTERM drains, a second one ends every open
request at once (streams get an error event) and the process exits with ``128 + signal``
instead of aborting."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from http_fakes import FakeRuntime, TinyCodec
from http_harness import raw_post, receive_until

from actors.config import RuntimeConfig
from app import AppSettings, ServerHandle
from ops.run_command import FORCED_STOP_MESSAGE, serve_until_signalled

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("second", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
async def test_a_second_signal_ends_streams_with_an_error_event(
        codec: TinyCodec, tmp_path: pathlib.Path, second: signal.Signals, status: int) -> None:
    rt = FakeRuntime(codec, gated=True, reply="one two three")
    closed = trio.Event()

    @asynccontextmanager
    async def open_fake(config: RuntimeConfig) -> AsyncIterator[FakeRuntime]:
        try:
            yield rt
        finally:
            closed.set()

    results: list[int] = []

    async def serve(task_status: trio.TaskStatus[ServerHandle]) -> None:
        results.append(await serve_until_signalled(
            open_fake, RuntimeConfig(model_dir=tmp_path), AppSettings(), host="127.0.0.1",
            port=0, grace_s=60, task_status=task_status))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server: ServerHandle = await nursery.start(serve)
            stream = await raw_post(server, "/v1/completions", {
                "prompt": "Hi", "max_tokens": 10, "stream": True})
            rt.release(1)
            received = await receive_until(stream, b'"text"')
            signal.raise_signal(signal.SIGTERM)
            await trio.testing.wait_all_tasks_blocked()
            assert server.service.draining
            signal.raise_signal(second)  # the stream stays gated: only the signal ends it
            received += await receive_until(stream, b"data: [DONE]")
            await stream.aclose()
    assert closed.is_set()
    assert results == [status]
    assert _events(received)[-1]["error"]["message"] == FORCED_STOP_MESSAGE


def _events(received: bytes) -> list[Any]:
    """The JSON ``data:`` payloads of a raw chunked SSE response."""
    payloads = (part.split(b"\r\n", 1)[0].strip() for part in received.split(b"data: ")[1:])
    return [json.loads(data) for data in payloads if data != b"[DONE]"]


def _read_log(stream: object, lines: list[str], seen: dict[str, threading.Event]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line)
        for event, flag in seen.items():
            if f'"event": "{event}"' in line:
                flag.set()


def test_flare_run_survives_two_sigterms_with_a_stream_in_flight() -> None:
    """A real ``flare run`` on the embedded model: two SIGTERMs while a long stream runs.
    The client gets an error event and ``[DONE]``, the process exits 143 promptly, and
    nothing aborts (no "terminate called" from device threads torn down at exit)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "run", "--port", "0", "--max-batch", "2",
         "--eager-forward", "--log-format", "json"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    seen = {name: threading.Event() for name in ("server.ready", "server.draining")}
    reader = threading.Thread(target=_read_log, args=(proc.stderr, lines, seen), daemon=True)
    reader.start()
    try:
        assert seen["server.ready"].wait(120), "".join(lines)
        ready = json.loads(next(line for line in lines if '"server.ready"' in line))
        port = int(ready["address"].rsplit(":", 1)[1])
        prepared = json.loads(next(line for line in lines if '"runtime.prepared"' in line))
        body = json.dumps({"prompt": "hello", "max_tokens": prepared["max_context"] - 8,
                           "stream": True, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            received = b""
            while b'"text"' not in received:  # the stream is producing tokens
                received += conn.recv(65536)
            proc.send_signal(signal.SIGTERM)
            assert seen["server.draining"].wait(30)
            proc.send_signal(signal.SIGTERM)
            forced_at = time.monotonic()
            while chunk := conn.recv(65536):
                received += chunk
        status = proc.wait(timeout=30)
        stop_s = time.monotonic() - forced_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert proc.stderr is not None
    proc.stderr.close()
    log = "".join(lines)
    assert _events(received)[-1]["error"]["message"] == FORCED_STOP_MESSAGE
    assert received.rstrip().endswith(b"data: [DONE]\n\n\r\n0")
    assert status == 143, log
    assert stop_s < 10, stop_s
    assert "terminate called" not in log
    assert '"exit_status": 143' in log
