"""``flare bench plan``: time the scheduler's ``plan()`` and ``complete()``.

Builds a realistic prepared catalog (prefill and scored-prefill ladders, every decode
bucket, an ordinary mixed grid, snapshot/restore state operations and a speculative
grid that ordinary selection skips: well over 100 shapes), keeps a steady population of
resident requests in mixed phases (long and short prompts, decoders, pending terminal
snapshots), and drives the production ``policy.Scheduler`` frame by frame with a
synthetic clock. Prints p50/p90/p99/max of ``plan()`` and ``complete()`` wall time and
thread CPU time (the CPU figure is the fairer one on a shared, oversubscribed machine),
the ``plan()`` CPU split between decisions with and without prerequisite-ready rows
(those also run the restore lookahead), and a calibration figure: the thread CPU time
of a fixed pure-Python loop, measured before and after the run, so runs on machines
or moments of different speed can be compared (scale by the calibration ratio).

The durations are synthetic (a fixed launch cost plus per-token and per-row costs);
they shape the decisions, not the timings measured here (VER-36: no throughput claim).
Results are recorded in docs/benchmarks-plan.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GraphKind,
    GraphShape,
    PolicyConfig,
    RestoreNeed,
    Scheduler,
    StateOp,
    TargetBinding,
)
from policy.config import PolicyConfigError

MS = 1_000_000
PREFILL_LADDER = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
MIXED_PROMPTS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def realistic_catalog() -> tuple[GraphShape, ...]:
    shapes: list[GraphShape] = []
    for kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        shapes += [GraphShape(kind=kind, batch_capacity=1, token_capacity=c)
                   for c in PREFILL_LADDER]
    shapes += [GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1,
                          packed_capacity=b) for b in BATCHES]
    shapes += [GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=1,
                          prefill_capacity=c, packed_capacity=c + b - 1)
               for b in BATCHES if b >= 2 for c in MIXED_PROMPTS]
    for op in (StateOp.SNAPSHOT, StateOp.RESTORE):
        shapes += [GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                              state_op=op) for b in (1, 2, 4, 8)]
    shapes += [GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                          proposal_depth=w - 1, packed_capacity=b * w,
                          binding=TargetBinding.QUERY_LENGTH)
               for b in BATCHES for w in (2, 3, 4)]
    return tuple(shapes)


def synthetic_duration_ns(shape: GraphShape) -> int:
    if shape.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        return round((3.0 + 0.02 * shape.token_capacity) * MS)
    if shape.kind is GraphKind.DECODE:
        return round((8.0 + 0.05 * shape.batch_capacity) * MS)
    if shape.kind is GraphKind.MIXED:
        return round((8.0 + 0.05 * shape.batch_capacity
                      + 0.018 * shape.prefill_capacity) * MS)
    if shape.kind is GraphKind.SPECULATIVE:
        return round((9.0 + 0.06 * shape.packed_capacity) * MS)
    return round((1.0 + 0.2 * shape.batch_capacity) * MS)


def admit_random(s: Scheduler, rng: random.Random) -> None:
    long_prompt = rng.random() < 0.25
    prompt = rng.randint(2000, 30_000) if long_prompt else rng.randint(16, 1500)
    ends = tuple(sorted(rng.sample(range(1, prompt), k=min(3, prompt - 1))))
    s.admit(prompt_len=prompt, max_output_tokens=rng.randint(8, 400),
            cached_prefix_len=rng.choice([0, 0, prompt // 2]), message_ends=ends,
            scored_prompt=rng.random() < 0.05,
            restore=RestoreNeed.READY if rng.random() < 0.05 else RestoreNeed.NONE)


CALIBRATION_ADDS = 2_000_000
CALIBRATION_EVERY = 200
"""Frames between the short calibration samples taken during a run."""


def calibration_ms(repeats: int = 3, adds: int = CALIBRATION_ADDS) -> float:
    """Thread CPU milliseconds of 2 M pure-Python integer additions (best of
    ``repeats``; ``adds`` smaller for a quick sample, scaled to 2 M): the machine's
    current speed for interpreter-bound work."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time_ns()
        total = 0
        for i in range(adds):
            total += i
        best = min(best, (time.thread_time_ns() - start) / 1e6)
    return best * CALIBRATION_ADDS / adds


def percentile(samples: Sequence[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] / 1000.0


def run(iterations: int, population: int, seed: int,
        config: PolicyConfig | None = None) -> dict[str, list[int] | list[float]]:
    rng = random.Random(seed)
    catalog = realistic_catalog()
    s = Scheduler(catalog=catalog, config=config)
    for shape in catalog:
        s.estimates.observe(shape, synthetic_duration_ns(shape), 1)
    s.advance_to(1)
    for _ in range(population):
        admit_random(s, rng)
    plan_ns: list[int] = []
    complete_ns: list[int] = []
    plan_cpu: list[int] = []
    complete_cpu: list[int] = []
    commit_cpu: list[int] = []
    restore_cpu: list[int] = []
    other_cpu: list[int] = []
    lanes: list[int] = []
    calibration: list[float] = []
    fence = 0
    for frame in range(iterations):
        if frame % CALIBRATION_EVERY == CALIBRATION_EVERY // 2:
            calibration.append(calibration_ms(repeats=1, adds=CALIBRATION_ADDS // 10))
        while len(s.handles()) < population:
            admit_random(s, rng)
        restorable = any(s.request(h).restorable for h in s.handles())
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        plan = s.plan()
        plan_cpu.append(time.thread_time_ns() - c0)
        plan_ns.append(time.perf_counter_ns() - t0)
        (restore_cpu if restorable else other_cpu).append(plan_cpu[-1])
        if plan is None:
            s.advance_to(s.now_ns + MS)
            continue
        fence += 1
        c0 = time.thread_time_ns()
        s.commit(plan, Fence(fence))
        commit_cpu.append(time.thread_time_ns() - c0)
        d = synthetic_duration_ns(plan.shape)
        s.advance_to(s.now_ns + d)
        records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                    prompt_tokens=lane.prompt_tokens,
                                    token_ids=(1,) * lane.token_ceiling,
                                    terminated=lane.token_ceiling > 0 and rng.random() < 0.01)
                   for lane in plan.lanes]
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        out = s.complete(Fence(fence), records, ExecutionTiming(device_intervals_ns=(d,),
                                                                wall_ns=d))
        complete_cpu.append(time.thread_time_ns() - c0)
        complete_ns.append(time.perf_counter_ns() - t0)
        lanes.append(len(plan.lanes))
        for token in out:
            if token.token_ids:
                s.published_output(token.handle, token.fence, s.now_ns)
        s.take_released()
    return {"plan": plan_ns, "complete": complete_ns, "plan cpu": plan_cpu,
            "commit cpu": commit_cpu, "complete cpu": complete_cpu, "lanes": lanes,
            "plan cpu, prerequisite-ready rows": restore_cpu,
            "plan cpu, no prerequisite-ready rows": other_cpu,
            "calibration": calibration, "shapes": [len(catalog)]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=3000,
                        help="frames to plan, commit and complete (default 3000)")
    parser.add_argument("--requests", type=int, default=64,
                        help="resident requests kept in mixed phases (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-drift-weight", type=float, default=0.0, metavar="W",
                        help="the estimates' shared speed factor weight (default 0; "
                             "flare run sets 0.1 on the cpu backend)")


def main(args: argparse.Namespace) -> int:
    try:
        config = PolicyConfig(cost_drift_weight=args.cost_drift_weight)
    except PolicyConfigError as exc:
        print(f"flare bench plan: --cost-drift-weight: {exc}", file=sys.stderr)
        return 2
    before = calibration_ms()
    result = run(args.iterations, args.requests, args.seed, config)
    after = calibration_ms()
    print(f"catalog shapes: {result['shapes'][0]}, resident requests: {args.requests}, "
          f"frames: {len(result['complete'])}, mean lanes per frame: "
          f"{statistics.fmean(result['lanes']):.1f}")
    rows = [("plan() wall", "plan"), ("complete() wall", "complete"),
            ("plan() cpu", "plan cpu"), ("commit() cpu", "commit cpu"),
            ("complete() cpu", "complete cpu"),
            ("plan() cpu, prerequisite-ready", "plan cpu, prerequisite-ready rows"),
            ("plan() cpu, others", "plan cpu, no prerequisite-ready rows")]
    for label, name in rows:
        samples = result[name]
        print(f"{label:>31}: p50 {percentile(samples, 0.50):7.1f} us  "
              f"p90 {percentile(samples, 0.90):7.1f} us  p99 {percentile(samples, 0.99):7.1f} us"
              f"  max {max(samples, default=0) / 1000:7.1f} us  (n={len(samples)})")
    during = result["calibration"]
    middle = f", median {statistics.median(during):.0f} ms over {len(during)} samples " \
        "during the run" if during else ""
    print(f"calibration (2 M Python integer additions, thread CPU): {before:.0f} ms before"
          f"{middle}, {after:.0f} ms after")
    return 0
