"""Maximal-body abuse under a probe stream, the soak and the idle keep-alive check.

The probe is one greedy stream that ignores EOS; its inter-token gaps (text chunk to
text chunk, the first token's wait left out) are measured once on an otherwise idle
server and once while another client sends maximal legal bodies back to back (a
prompt and a 2,048-message chat of about the size limit, alternately), from the probe's
first token until it ends. The figure is the p99 gap of each run and their ratio.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import httpx
import trio

from ops.chaos.cases import CHAT, COMPLETIONS, http_request, maximal_chat, maximal_prompt
from ops.chaos.phases import Endpoint, Observe, sse_text, timed_post
from ops.chaos.report import PhaseResult
from ops.chaos.wire import exchange


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(max(int(q * len(ordered) + 0.5) - 1, 0), len(ordered) - 1)]


@dataclass(slots=True)
class ProbeRun:
    gaps_ms: list[float] = field(default_factory=list)
    status: int | None = None
    hang: bool = False
    completed: bool = False
    seconds: float = 0.0


async def probe_stream(http: httpx.AsyncClient, *, max_tokens: int, time_limit_s: float,
                       first_token: trio.Event | None = None) -> ProbeRun:
    """One streamed completion; a read with no progress for the client's timeout is a
    hang, running past ``time_limit_s`` only ends the measurement."""
    run = ProbeRun()
    body = {"prompt": "def f(", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    started = trio.current_time()
    last: float | None = None
    with trio.move_on_after(time_limit_s):
        try:
            async with http.stream("POST", COMPLETIONS, json=body) as response:
                run.status = response.status_code
                async for line in response.aiter_lines():
                    if sse_text(line) is None:
                        continue
                    now = trio.current_time()
                    if last is None and first_token is not None:
                        first_token.set()
                    if last is not None:
                        run.gaps_ms.append((now - last) * 1000)
                    last = now
                run.completed = True
        except httpx.TimeoutException:
            run.hang = True
        except httpx.HTTPError:
            pass
    if first_token is not None:
        first_token.set()  # never leave the abuser waiting
    run.seconds = trio.current_time() - started
    return run


def _record(result: PhaseResult, run: ProbeRun) -> None:
    result.add(run.status, hang=run.hang)


async def _cpu(observe: Observe | None) -> float | None:
    now = None if observe is None else await observe()
    return None if now is None else now.cpu_s


async def run_abuse(ep: Endpoint, *, probe_tokens: int, bodies: int, body_bytes: int,
                    time_limit_s: float, observe: Observe | None = None) -> PhaseResult:
    """The probe idle, then the probe while maximal bodies arrive (at most ``bodies``).

    With ``observe``, the server's CPU time is read around each probe: what the abused
    probe cost beyond the idle one, per body sent, is the serving process's CPU per
    maximal body (a figure other load on the machine hardly moves)."""
    result = PhaseResult("abuse")
    target = ep.case_target()
    requests = [http_request(target, "POST", COMPLETIONS, maximal_prompt(body_bytes)),
                http_request(target, "POST", CHAT, maximal_chat(body_bytes))]
    sent = 0
    abuse_statuses: dict[str, int] = {}
    begin = trio.current_time()
    async with ep.client() as http:
        cpu_start = await _cpu(observe)
        idle = await probe_stream(http, max_tokens=probe_tokens, time_limit_s=time_limit_s)
        cpu_idle = await _cpu(observe)
        _record(result, idle)
        first, done = trio.Event(), trio.Event()

        async def abuser() -> None:
            nonlocal sent
            await first.wait()
            for request in itertools.islice(itertools.cycle(requests), bodies):
                if done.is_set():
                    return
                got = await exchange(ep.host, ep.port, request, timeout_s=ep.request_timeout_s)
                sent += 1
                result.add(got.status, hang=got.hang)
                key = "hang" if got.hang else str(got.status)
                abuse_statuses[key] = abuse_statuses.get(key, 0) + 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abuser)
            abused = await probe_stream(http, max_tokens=probe_tokens, time_limit_s=time_limit_s,
                                        first_token=first)
            done.set()
        cpu_end = await _cpu(observe)
        _record(result, abused)
    result.seconds = trio.current_time() - begin
    idle_p99, abuse_p99 = percentile(idle.gaps_ms, 0.99), percentile(abused.gaps_ms, 0.99)
    result.figures.update(
        idle_p99_ms=idle_p99, abuse_p99_ms=abuse_p99,
        ratio=abuse_p99 / idle_p99 if idle_p99 and abuse_p99 is not None else None,
        idle_p50_ms=percentile(idle.gaps_ms, 0.5), abuse_p50_ms=percentile(abused.gaps_ms, 0.5),
        idle_max_ms=max(idle.gaps_ms, default=None), abuse_max_ms=max(abused.gaps_ms, default=None),
        idle_gaps=len(idle.gaps_ms), abuse_gaps=len(abused.gaps_ms),
        idle_seconds=round(idle.seconds, 3), abuse_seconds=round(abused.seconds, 3),
        abuse_probe_completed=abused.completed, abuse_bodies_sent=sent,
        abuse_body_bytes=len(requests[0]), abuse_answers=abuse_statuses,
        server_cpu_ms_per_body=per_body(cpu_start, cpu_idle, cpu_end, sent))
    return result


def per_body(start: float | None, idle: float | None, end: float | None,
              bodies: int) -> float | None:
    """Milliseconds of server CPU per body: the abused probe's CPU less the idle one's."""
    if start is None or idle is None or end is None or not bodies:
        return None
    return round(max((end - idle) - (idle - start), 0.0) * 1000 / bodies, 1)


async def _soak_stream(http: httpx.AsyncClient, result: PhaseResult, path: str,
                       body: dict[str, object], timeout_s: float) -> None:
    with trio.move_on_after(timeout_s) as scope:
        try:
            async with http.stream("POST", path, json=body) as response:
                async for _ in response.aiter_lines():
                    pass
            result.add(response.status_code)
        except httpx.TimeoutException:
            result.add(None, hang=True)
        except httpx.HTTPError:
            result.add(None)
    if scope.cancelled_caught:
        result.add(None, hang=True)


async def run_soak(ep: Endpoint, *, count: int, concurrency: int, max_tokens: int) -> PhaseResult:
    """``count`` ordinary requests from ``concurrency`` closed-loop clients: completions
    and chat, streamed and not, in turn."""
    result = PhaseResult("soak")
    latencies: list[float] = []
    queue = iter(range(count))
    begin = trio.current_time()
    async with ep.client() as http:
        async def worker() -> None:
            for i in queue:
                chat = i % 4 >= 2
                path = CHAT if chat else COMPLETIONS
                body: dict[str, object] = (
                    {"messages": [{"role": "user", "content": f"import os  # {i}"}]} if chat
                    else {"prompt": f"def f{i}("})
                body["max_tokens"] = max_tokens
                started = trio.current_time()
                if i % 2:
                    body["stream"] = True
                    await _soak_stream(http, result, path, body, ep.request_timeout_s)
                else:
                    await timed_post(http, result, path, body, ep.request_timeout_s)
                latencies.append(trio.current_time() - started)

        async with trio.open_nursery() as nursery:
            for _ in range(min(concurrency, count)):
                nursery.start_soon(worker)
    result.seconds = trio.current_time() - begin
    result.figures.update(latency_p50_s=percentile(latencies, 0.5),
                          latency_p99_s=percentile(latencies, 0.99))
    return result


async def run_idle(ep: Endpoint, *, connections: int, idle_timeout_s: float) -> PhaseResult:
    """``connections`` keep-alive connections each answered once and then left idle: the
    server must close each within ``idle_timeout_s``."""
    result = PhaseResult("idle")
    target = ep.case_target()
    request = http_request(target, "POST", COMPLETIONS, b'{"prompt": "x", "max_tokens": 1}')
    closed = 0
    begin = trio.current_time()

    async def one() -> None:
        nonlocal closed
        got = await exchange(ep.host, ep.port, request, timeout_s=ep.request_timeout_s,
                             close_timeout_s=idle_timeout_s, want_close=True)
        result.add(got.status, hang=got.hang)
        closed += got.closed is True

    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(one)
    result.seconds = trio.current_time() - begin
    result.figures.update(connections=connections, closed=closed,
                          not_closed=connections - closed, idle_timeout_s=idle_timeout_s)
    return result
