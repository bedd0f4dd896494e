"""The battery, the disconnect storm, the overload burst and the slow readers.

Every phase is bounded in count (its size) and in time (each request has the request
timeout; a phase stops at its own limit). Traffic goes only to the endpoint given,
which ``flare bench chaos`` keeps on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from ops.chaos.cases import BASES, CHAT, COMPLETIONS, CaseTarget, battery, http_request, json_object
from ops.chaos.report import PhaseResult
from ops.chaos.server_process import Snapshot
from ops.chaos.wire import Reader, abortive, connect_small_window, exchange, parse_head

Observe = Callable[[], Awaitable[Snapshot | None]]
"""Reads the server's resources now (None: not readable for this target)."""
SHOWN_UNEXPECTED = 60  # battery cases listed by name in the report


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    host: str
    port: int
    api_key: str | None = None
    request_timeout_s: float = 20.0
    close_timeout_s: float = 5.0
    max_request_bytes: int = 4 * 1024 * 1024

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def case_target(self) -> CaseTarget:
        return CaseTarget(host=f"{self.host}:{self.port}", api_key=self.api_key,
                          max_request_bytes=self.max_request_bytes)

    def client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(self.request_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    def stream_request(self, index: int, max_tokens: int) -> bytes:
        """A streaming request (completions or chat by ``index``) that ignores EOS."""
        path = COMPLETIONS if index % 2 == 0 else CHAT
        fields = {**BASES[path], "max_tokens": str(max_tokens), "stream": "true",
                  "ignore_eos": "true"}
        if path == CHAT:
            fields["max_completion_tokens"] = str(max_tokens)
        body = json_object(fields)
        return http_request(self.case_target(), "POST", path, body)


def _expected(expect: str, status: int | None) -> bool:
    return expect == "any" or (status is not None and f"{status // 100}xx" == expect)


async def run_battery(ep: Endpoint, *, quick: bool, concurrency: int) -> PhaseResult:
    """Every case once, ``concurrency`` at a time."""
    result = PhaseResult("battery")
    unexpected: list[str] = []
    not_json: list[str] = []
    not_closed = 0
    limiter = trio.CapacityLimiter(concurrency)
    cases = battery(ep.case_target(), quick=quick)

    async def one(index: int) -> None:
        nonlocal not_closed
        case = cases[index]
        async with limiter:
            got = await exchange(ep.host, ep.port, case.request, timeout_s=ep.request_timeout_s,
                                 close_timeout_s=ep.close_timeout_s, want_close=case.closes)
        result.add(got.status, hang=got.hang)
        if got.hang or not _expected(case.expect, got.status):
            shown = "hang" if got.hang else (got.status or "dropped")
            unexpected.append(f"{case.name}: {case.expect} -> {shown}")
        if got.status is not None and got.status >= 400 and "json" not in got.headers.get(
                "content-type", ""):
            not_json.append(f"{case.name}: {got.status}")
        if case.closes and got.closed is not True:
            not_closed += 1

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(len(cases)):
            nursery.start_soon(one, i)
    result.seconds = trio.current_time() - started
    unexpected.sort()
    result.figures.update(unexpected=len(unexpected), error_not_json=len(not_json),
                          error_not_json_cases=sorted(not_json)[:SHOWN_UNEXPECTED],
                          not_closed_when_asked=not_closed,
                          closes_asked=sum(c.closes for c in cases),
                          unexpected_cases=unexpected[:SHOWN_UNEXPECTED])
    return result


async def _start_and_leave(ep: Endpoint, request: bytes, *, chunks: int, reset: bool
                           ) -> tuple[int | None, bool, bool]:
    """Start a stream, read until ``chunks`` data events arrived, then disconnect (an RST
    with ``reset``). Returns (status, whether the stream started, hang)."""
    stream = await trio.open_tcp_stream(ep.host, ep.port)
    status: int | None = None
    started = False
    with trio.move_on_after(ep.request_timeout_s) as scope:
        await stream.send_all(request)
        reader = Reader(stream)
        head = await reader.until(b"\r\n\r\n")
        parsed = None if head is None else parse_head(head)
        if parsed is not None:
            status = parsed[0]
            while status == 200 and reader.buffer.count(b"data:") < chunks:
                if not await reader.fill():
                    break
            started = status == 200 and reader.buffer.count(b"data:") >= chunks
    if reset:
        abortive(stream)
    await stream.aclose()
    return status, started, scope.cancelled_caught


async def in_flight(ep: Endpoint) -> int | None:
    """``requests_in_flight`` of ``GET /health`` (None: unreadable)."""
    async with ep.client() as http:
        try:
            response = await http.get("/health")
            value = response.json().get("requests_in_flight")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
    return value if isinstance(value, int) else None


async def wait_idle(ep: Endpoint, timeout_s: float) -> tuple[int | None, float]:
    """Poll ``/health`` until no request is in flight (bounded by ``timeout_s``)."""
    started = trio.current_time()
    count = await in_flight(ep)
    with trio.move_on_after(timeout_s):
        while count != 0:
            await trio.sleep(0.25)  # polling a remote server's state; nothing to wait on
            count = await in_flight(ep)
    return count, trio.current_time() - started


async def run_storm(ep: Endpoint, *, waves: int, clients: int, max_tokens: int) -> PhaseResult:
    """``waves`` waves of ``clients`` streams that disconnect after one to three chunks
    (every third with an RST), then how long the server takes to forget them."""
    result = PhaseResult("storm")
    started_streams = 0
    begin = trio.current_time()
    for wave in range(waves):
        async def client(i: int) -> None:
            nonlocal started_streams
            try:
                status, started, hang = await _start_and_leave(
                    ep, ep.stream_request(i, max_tokens), chunks=1 + i % 3, reset=i % 3 == 0)
            except (OSError, trio.BrokenResourceError):
                status, started, hang = None, False, False  # refused or reset: a drop
            result.add(status, hang=hang)
            started_streams += started

        async with trio.open_nursery() as nursery:
            for i in range(clients):
                nursery.start_soon(client, wave * clients + i)
    left, drain_s = await wait_idle(ep, ep.request_timeout_s)
    result.seconds = trio.current_time() - begin
    result.figures.update(streams_started=started_streams, in_flight_after=left,
                          drain_seconds=round(drain_s, 3))
    return result


async def timed_post(http: httpx.AsyncClient, result: PhaseResult, path: str,
                     body: dict[str, Any], timeout_s: float) -> httpx.Response | None:
    """One non-streaming POST recorded in ``result`` (a hang past ``timeout_s``)."""
    with trio.move_on_after(timeout_s) as scope:
        try:
            response = await http.post(path, json=body)
        except httpx.TimeoutException:
            result.add(None, hang=True)
            return None
        except httpx.HTTPError:
            result.add(None)
            return None
        result.add(response.status_code)
        return response
    if scope.cancelled_caught:
        result.add(None, hang=True)
    return None


async def run_burst(ep: Endpoint, *, count: int, max_tokens: int) -> PhaseResult:
    """``count`` concurrent requests at once: those beyond the queue must get 429 with
    ``Retry-After``."""
    result = PhaseResult("burst")
    missing = 0
    body = {"prompt": "def f(", "max_tokens": max_tokens, "ignore_eos": True}
    begin = trio.current_time()
    async with ep.client() as http:
        async def one() -> None:
            nonlocal missing
            response = await timed_post(http, result, COMPLETIONS, body, ep.request_timeout_s)
            if response is not None and response.status_code == 429 and (
                    "retry-after" not in response.headers):
                missing += 1

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
    result.seconds = trio.current_time() - begin
    result.figures.update(rejected_429=result.outcomes.get("429", 0), retry_after_missing=missing)
    return result


async def run_slow_readers(ep: Endpoint, *, count: int, hold_s: float, max_tokens: int,
                           observe: Observe) -> PhaseResult:
    """``count`` clients start long streams on small receive windows and never read; while
    they hold, an ordinary request must still be served; then they go away."""
    result = PhaseResult("slow readers")
    begin = trio.current_time()
    streams: list[trio.SocketStream] = []
    try:
        for i in range(count):
            try:
                stream = await connect_small_window(ep.host, ep.port)
                streams.append(stream)
                await stream.send_all(ep.stream_request(i, max_tokens))
            except (OSError, trio.BrokenResourceError):
                result.add(None)  # refused or reset before the request was sent
        async with ep.client() as http, trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep, hold_s)  # the hold; the probe runs meanwhile
            probe_started = trio.current_time()
            response = await timed_post(http, result, COMPLETIONS,
                                        {"prompt": "def f(", "max_tokens": 8},
                                        ep.request_timeout_s)
            result.figures["probe_seconds"] = round(trio.current_time() - probe_started, 3)
            result.figures["probe_status"] = None if response is None else response.status_code
        during = await observe()
        if during is not None:
            result.figures["server_connections_during_hold"] = during.open_connections
            result.figures["rss_bytes_during_hold"] = during.rss_bytes
    finally:
        for i, stream in enumerate(streams):
            if i % 2 == 0:
                abortive(stream)
            await stream.aclose()
    left, drain_s = await wait_idle(ep, ep.request_timeout_s)
    result.seconds = trio.current_time() - begin
    result.figures.update(readers=len(streams), in_flight_after=left,
                          drain_seconds=round(drain_s, 3))
    return result


def sse_text(line: str) -> str | None:
    """The output text of one SSE ``data:`` line (None: not a text chunk)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return None
    choices = event.get("choices") if isinstance(event, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            delta = choice.get("delta")
            text = choice.get("text") or (delta.get("content") if isinstance(delta, dict)
                                          else None)
            if isinstance(text, str) and text:
                return text
    return None
