"""One chaos run: warm-up, starting figures, the phases in order, settling, final figures.

The starting figures are taken after a few ordinary requests (the first requests
allocate what any serving does); the final ones once the server has settled: no
request in flight, no connection open, RSS and descriptors back within the tolerance,
or ``settle_s`` passed, whichever is first. A sampler keeps the peaks meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import trio

from ops.chaos.phases import (
    Endpoint,
    Observe,
    run_battery,
    run_burst,
    run_slow_readers,
    run_storm,
    wait_idle,
)
from ops.chaos.report import RESOURCE_TOLERANCE, ChaosReport, PhaseResult
from ops.chaos.server_process import Snapshot
from ops.chaos.streams import run_abuse, run_idle, run_soak

PHASES = ("battery", "storm", "burst", "slow", "abuse", "soak", "idle")
SAMPLE_EVERY_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """How big each phase is (``QUICK``: a run of well under a minute, for tests)."""

    quick: bool = False
    battery_concurrency: int = 4
    storm_waves: int = 5
    storm_clients: int = 20
    storm_tokens: int = 64
    burst: int = 100
    burst_tokens: int = 16
    slow_readers: int = 8
    slow_hold_s: float = 8.0
    slow_tokens: int = 1500
    probe_tokens: int = 300
    abuse_bodies: int = 12
    abuse_bytes: int = 0
    """Size of each abusive body; 0: just under the request size limit."""
    abuse_time_s: float = 45.0
    soak_requests: int = 200
    soak_concurrency: int = 8
    soak_tokens: int = 8
    idle_connections: int = 10
    idle_timeout_s: float = 10.0
    settle_s: float = 15.0


QUICK = Sizes(quick=True, battery_concurrency=8, storm_waves=2, storm_clients=5,
              storm_tokens=32, burst=40, burst_tokens=4, slow_readers=3, slow_hold_s=2.0,
              slow_tokens=600, probe_tokens=80, abuse_bodies=2, abuse_bytes=256 * 1024,
              abuse_time_s=30.0, soak_requests=24, soak_concurrency=4, idle_connections=3,
              idle_timeout_s=6.0, settle_s=6.0)
SIZE_FIELDS = tuple(f.name for f in fields(Sizes) if f.name != "quick")


def _within(before: Snapshot | None, now: Snapshot | None) -> bool:
    if before is None or now is None:
        return True
    for b, n in ((before.rss_bytes, now.rss_bytes), (before.fds, now.fds)):
        if b is not None and n is not None and n > b * (1 + RESOURCE_TOLERANCE):
            return False
    return now.open_connections == 0


async def _settle(ep: Endpoint, observe: Observe, before: Snapshot | None, timeout_s: float
                  ) -> tuple[Snapshot | None, float]:
    started = trio.current_time()
    with trio.move_on_after(timeout_s):
        await wait_idle(ep, timeout_s)
        while True:
            if _within(before, await observe()):
                break
            await trio.sleep(SAMPLE_EVERY_S)  # polling another process's resources
    return await observe(), trio.current_time() - started


async def _phase(name: str, ep: Endpoint, sizes: Sizes, observe: Observe) -> PhaseResult:
    s = sizes
    if name == "battery":
        return await run_battery(ep, quick=s.quick, concurrency=s.battery_concurrency)
    if name == "storm":
        return await run_storm(ep, waves=s.storm_waves, clients=s.storm_clients,
                               max_tokens=s.storm_tokens)
    if name == "burst":
        return await run_burst(ep, count=s.burst, max_tokens=s.burst_tokens)
    if name == "slow":
        return await run_slow_readers(ep, count=s.slow_readers, hold_s=s.slow_hold_s,
                                      max_tokens=s.slow_tokens, observe=observe)
    if name == "abuse":
        return await run_abuse(ep, probe_tokens=s.probe_tokens, bodies=s.abuse_bodies,
                               body_bytes=s.abuse_bytes or ep.max_request_bytes - 4096,
                               time_limit_s=s.abuse_time_s, observe=observe)
    if name == "soak":
        return await run_soak(ep, count=s.soak_requests, concurrency=s.soak_concurrency,
                              max_tokens=s.soak_tokens)
    if name == "idle":
        return await run_idle(ep, connections=s.idle_connections, idle_timeout_s=s.idle_timeout_s)
    raise ValueError(f"unknown phase {name!r}")


async def run_chaos(ep: Endpoint, sizes: Sizes, observe: Observe, *,
                    phases: tuple[str, ...] = PHASES,
                    progress: Callable[[str], None] = lambda _: None) -> ChaosReport:
    report = ChaosReport(target=ep.base_url, phases=[])
    peak = {"rss": 0, "fds": 0}

    async def sample() -> None:
        while True:
            now = await observe()
            if now is not None:
                peak["rss"] = max(peak["rss"], now.rss_bytes or 0)
                peak["fds"] = max(peak["fds"], now.fds or 0)
            await trio.sleep(SAMPLE_EVERY_S)  # a sampling period, not a synchronisation

    progress("warm-up")
    await run_soak(ep, count=4, concurrency=2, max_tokens=sizes.soak_tokens)
    await wait_idle(ep, ep.request_timeout_s)
    report.before = await observe()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        for name in phases:
            progress(name)
            report.phases.append(await _phase(name, ep, sizes, observe))
        progress("settling")
        report.after, report.settle_seconds = await _settle(ep, observe, report.before,
                                                            sizes.settle_s)
        nursery.cancel_scope.cancel()
    if report.before is not None:
        report.peak = Snapshot(rss_bytes=peak["rss"] or None, fds=peak["fds"] or None)
    return report
