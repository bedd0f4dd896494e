"""The speculation benchmark's modes on a simulated device: no speculation, each fixed
proposal depth, adaptive under a chosen preset (``flare bench speculation --simulate``).

On the 2-vCPU machine a real benchmark's cells move by 20-35 points between repeats, so
it cannot show whether adaptive's *choices* match the best fixed depth within a few
percent. This module runs the same policies on ``ops.sim``: the program durations come
from a measured ``flare bench programs --json`` table (each shape's median), the
acceptance of each drafted token is a per-request rate drawn with common random
numbers (``ops.sim.engine``: every mode sees the same draws for the same request), and
everything else is the real policy code, with the learned draft's counterfactual
observations as ``flare run`` makes them (``SimOptions.draft_counterfactuals``). The
result is deterministic, so a difference between modes is the policy's, not the
machine's. What it leaves out: host time (planning runs in zero simulated time; the
bench's ``--simulate-host-ms`` adds a fixed time per frame) and the draft model's own
acceptance structure (real acceptance varies within a request; here it is independent
per position, which gives adaptive nothing to exploit beyond each request's rate).

A load is ``streams`` concurrent streams: every request arrives at time zero and at
most ``streams`` are resident (first come, first served), so a finished request's row
goes to the next one at once, as in the bench's closed loop. The first
``streams * warm_up_requests`` requests warm the population acceptance priors (as the
bench's warm-up requests do); the measured window runs from the first measured
request's first token to the last measured request's last, and counts every token
delivered in it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ops.loadgen.workload import LengthSpec
from ops.sim.catalogs import Catalogs, build_catalogs
from ops.sim.costs import CostTable
from ops.sim.engine import SimOptions, simulate
from ops.sim.workloads import build_workload, scenario
from policy.baselines import make_policy
from policy.config import policy_preset
from policy.descriptors import GraphShape
from policy.protocol import SchedulingPolicy

__all__ = ["SweepFigures", "SweepLoad", "SweepMode", "mode_catalog", "simulate_mode",
           "sweep_catalogs"]


@dataclass(frozen=True, slots=True)
class SweepMode:
    """One bench mode: ``off``, ``fixed`` at ``depth``, or ``adaptive`` up to ``depth``."""

    speculation: str
    depth: int
    policy: str = "balanced"


@dataclass(frozen=True, slots=True)
class SweepLoad:
    streams: int
    requests_per_stream: int
    warm_up_requests: int
    prompt_tokens: int
    output_tokens: int
    acceptance: float
    acceptance_spread: float = 0.1
    seed: int = 0
    draft_counterfactuals: bool = True
    """Adaptive modes observe the learned draft's counterfactuals, as ``flare run``
    does for the learned source by default (``SimOptions.draft_counterfactuals``)."""


@dataclass(frozen=True, slots=True)
class SweepFigures:
    """What the bench prints for one mode and load, measured in simulated time
    (acceptance and speculative share over the whole run, warm-up included)."""

    tokens: int
    seconds: float
    mean_itl_ms: float
    mean_gap_ms: float
    acceptance: float
    speculative_share: float


def sweep_catalogs(*, max_batch: int, mixed_prefill: bool, depths: Sequence[int],
                   state_operations: bool = False) -> dict[int, Catalogs]:
    """The catalogs ``flare run`` would load for each draft depth (0: no speculation);
    ``state_operations`` adds the state-operation programs ``flare run`` leaves out."""
    return {d: build_catalogs(max_batch=max_batch, prefill_capacities=(64,),
                              mixed_prefill=mixed_prefill, draft_depth=d,
                              state_operations=state_operations)
            for d in {0, *depths}}


def mode_catalog(mode: SweepMode, catalogs: dict[int, Catalogs]) -> tuple[GraphShape, ...]:
    """The shapes ``mode``'s server serves: the ordinary catalog, the fixed-width subset
    of the depth's speculative load, or the whole load (``actors.catalog_setup.served_shapes``)."""
    if mode.speculation == "off":
        return catalogs[0].ordinary
    load = catalogs[mode.depth]
    return load.fixed_width if mode.speculation == "fixed" else load.speculative


def _planner(mode: SweepMode, shapes: tuple[GraphShape, ...]) -> SchedulingPolicy:
    """The seed's scheduler as ``flare run`` builds it for ``mode`` (``make_policy``)."""
    if mode.speculation == "off":
        return make_policy(mode.policy, catalog=shapes)
    name = "spec-adaptive" if mode.speculation == "adaptive" else "spec-fixed"
    return make_policy(name, policy_preset(mode.policy), catalog=shapes)


def simulate_mode(mode: SweepMode, load: SweepLoad, *, catalogs: dict[int, Catalogs],
                  costs: CostTable) -> SweepFigures:
    """Run ``load`` under ``mode`` on the simulated device; figures over the measured
    window (module docstring)."""
    warm = load.streams * load.warm_up_requests
    count = warm + load.streams * load.requests_per_stream
    spec = scenario("poisson", count=count, rate=1.0, seed=load.seed,
                    lengths=LengthSpec(kind="fixed", prompt_tokens=load.prompt_tokens,
                                       output_tokens=load.output_tokens),
                    acceptance=load.acceptance, acceptance_spread=load.acceptance_spread)
    requests = [replace(r, arrival_s=0.0) for r in build_workload(spec)]
    options = SimOptions(max_resident=load.streams, output_limit=0, seed=load.seed,
                         draft_counterfactuals=load.draft_counterfactuals)
    result = simulate(_planner(mode, mode_catalog(mode, catalogs)), requests, costs, options)
    measured = [r for r in result.records if r.index >= warm]
    start = min(r.chunk_times_s[0] for r in measured)
    end = max(r.chunk_times_s[-1] for r in measured)
    tokens = sum(n for r in result.records
                 for t, n in zip(r.chunk_times_s, r.chunk_tokens, strict=True)
                 if start <= t <= end)
    itls, gaps = [], []
    for r in measured:
        span = r.chunk_times_s[-1] - r.chunk_times_s[0]
        after_first = sum(r.chunk_tokens) - 1  # the first burst's first token starts it
        if after_first > 0:
            itls.append(span / after_first)
        if len(r.chunk_times_s) > 1:
            gaps.append(span / (len(r.chunk_times_s) - 1))
    spec_stats = result.speculation
    frames = sum(result.frames.values())
    return SweepFigures(
        tokens=round(tokens), seconds=end - start,
        mean_itl_ms=1e3 * statistics.fmean(itls) if itls else 0.0,
        mean_gap_ms=1e3 * statistics.fmean(gaps) if gaps else 0.0,
        acceptance=spec_stats["accepted"] / spec_stats["drafted"]
        if spec_stats["drafted"] else 0.0,
        speculative_share=result.frames.get("speculative", 0) / frames if frames else 0.0)
