"""Large bodies are checked in a parse worker process, not in the serving process: a
body the checks refuse (too long for the context, not JSON, an unknown field) is
answered from the worker and never decoded where the streams are served; small bodies
stay on the serving process's direct path; a worker that dies costs no request."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import running_server

from app import AppSettings, ServerHandle
from app import parse_workers as parse_workers_module
from app import routes as routes_module
from app.parse_workers import ParseWorkers
from app.service import OFFLOAD_BYTES

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
WITH_WORKER = AppSettings(parse_workers=1)


@pytest.fixture
def parsed_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The sizes of the bodies the serving process decodes (the routes' one decoder)."""
    sizes: list[int] = []
    original = routes_module.parse_json_object

    def recording(raw: bytes) -> dict[str, Any]:
        sizes.append(len(raw))
        return original(raw)

    monkeypatch.setattr(routes_module, "parse_json_object", recording)
    yield sizes


def _client(server: ServerHandle) -> httpx.AsyncClient:
    """A client that waits out the worker's start-up (a fresh interpreter)."""
    return httpx.AsyncClient(base_url=server.url, timeout=60)


def _workers(server: ServerHandle) -> ParseWorkers:
    workers = server.service.parse_workers
    assert workers is not None
    return workers


async def test_a_refused_large_body_is_never_decoded_in_the_serving_process(
        codec: TinyCodec, parsed_here: list[int]) -> None:
    rt = FakeRuntime(codec, max_context=256)
    long_prompt = json.dumps({"prompt": "word " * 200_000, "max_tokens": 1}).encode()
    long_chat = json.dumps({"max_tokens": 1, "messages": [
        {"role": "user", "content": "w" * 400} for _ in range(2048)]}).encode()
    broken = b'{"prompt": "' + b"x" * (2 * OFFLOAD_BYTES) + b'", "max_tokens": }'
    unknown = json.dumps({"prompt": "x" * (2 * OFFLOAD_BYTES), "temprature": 1}).encode()
    with trio.fail_after(120):
        async with running_server(rt, WITH_WORKER) as server, \
                _client(server) as client:
            answers = [await client.post(path, content=body, headers=JSON) for path, body in
                       [(COMPLETIONS, long_prompt), (CHAT, long_chat), (COMPLETIONS, broken),
                        (COMPLETIONS, unknown)]]
            small = await client.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 1})
            checked = _workers(server).checked
    errors = [a.json()["error"] for a in answers]
    assert [a.status_code for a in answers] == [400] * 4
    assert [(e["param"], e["code"]) for e in errors[:2]] == [
        ("prompt", "context_length_exceeded"), ("messages", "context_length_exceeded")]
    assert "not valid JSON" in errors[2]["message"]
    assert errors[3]["param"] == "temprature"
    assert checked == 4
    assert small.status_code == 200
    # only the small body was decoded where the streams are served
    assert len(parsed_here) == 1 and parsed_here[0] < OFFLOAD_BYTES
    assert rt.requests and len(rt.requests) == 1


async def test_a_large_body_the_worker_passes_is_served(
        codec: TinyCodec, parsed_here: list[int]) -> None:
    rt = FakeRuntime(codec, max_context=1_000_000)
    text = "The quick brown fox jumps over the lazy dog. " * (2 * OFFLOAD_BYTES // 45)
    with trio.fail_after(120):
        async with running_server(rt, WITH_WORKER) as server, \
                _client(server) as client:
            served = await client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 1})
            tokenized = await client.post("/tokenize", json={"prompt": text})
            checked = _workers(server).checked
    assert served.status_code == 200 and tokenized.status_code == 200
    assert checked == 2
    assert len(parsed_here) == 2 and min(parsed_here) >= OFFLOAD_BYTES  # then prepared here


async def _exited(pid: int) -> None:
    """Wait until process ``pid`` has exited, without reaping it."""
    fd = os.pidfd_open(pid)
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def test_a_lost_worker_costs_no_request(codec: TinyCodec, parsed_here: list[int]) -> None:
    rt = FakeRuntime(codec, max_context=256)
    body = json.dumps({"prompt": "word " * 200_000, "max_tokens": 1}).encode()
    with trio.fail_after(120):
        async with running_server(rt, WITH_WORKER) as server, \
                _client(server) as client:
            workers = _workers(server)
            first = await client.post(COMPLETIONS, content=body, headers=JSON)
            (pid,) = workers.pids()
            os.kill(pid, signal.SIGKILL)
            await _exited(pid)
            lost = await client.post(COMPLETIONS, content=body, headers=JSON)
            after = await client.post(COMPLETIONS, content=body, headers=JSON)
            replaced, checked, pids = workers.replaced, workers.checked, workers.pids()
    for answer in (first, lost, after):
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert replaced == 1 and pids and pid not in pids
    assert checked == 2  # the request that met the dead worker was checked here
    assert parsed_here == [len(body)]


async def test_without_a_worker_bodies_are_checked_in_the_serving_process(
        codec: TinyCodec, parsed_here: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse_workers_module, "WORKER_PROGRAM", ("-c", "pass"))  # exits at once
    rt = FakeRuntime(codec, max_context=256)
    body = json.dumps({"prompt": "word " * 200_000, "max_tokens": 1}).encode()
    with trio.fail_after(120):
        async with running_server(rt, WITH_WORKER) as server, _client(server) as client:
            answers = [await client.post(COMPLETIONS, content=body, headers=JSON)
                       for _ in range(2)]
            workers = _workers(server)
    for answer in answers:
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert workers.checked == 0 and workers.pids() == []
    assert parsed_here == [len(body)] * 2
