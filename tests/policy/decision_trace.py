"""Seeded synthetic runs of the production ``Scheduler`` recorded as decision digests.

``test_decision_equivalence.py`` replays these runs and compares every ``plan()`` with
the recorded fixture ``data/decision_trace.json``, which was generated from the
table-based scheduler, before the performance work on ``plan()``/``complete()``
(docs/benchmarks-plan.md). A plan is serialised field by field (catalog position of the
shape, reason, timing, flags, every lane with its floats as ``float.hex``), so a digest
match means a bit-identical decision. The runs cover what the performance work touches:

- ``bench``: the ``flare bench plan`` population (64 residents, every shape measured,
  restore-ready admissions) plus initialization stages (multistage rows, PRE-21);
- ``explore``: half the catalog unmeasured (discovery, DUR-22), a 150 ms freshness
  interval with jittered samples (stale estimates, timing refresh, median changes),
  decode frames queued behind decode frames (projection, QUEUE-41..43), cancellations,
  preemptions, malformed lanes, held-back publications, awaiting restorations;
- ``small``: a handful of residents with system boundaries (SEL-40) and message ends.

Regenerate (only when a decision change is intended and reviewed)::

    PYTHONPATH=. .venv/bin/python tests/policy/decision_trace.py
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GraphKind,
    GraphShape,
    RequestHandle,
    RestoreNeed,
    ScheduledPlan,
    Scheduler,
    StateOp,
    TargetBinding,
)
from policy.config import PolicyConfig

MS = 1_000_000
FIXTURE = Path(__file__).parent / "data" / "decision_trace.json"


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    frames: int
    population: int
    measured_fraction: float = 1.0
    ttl_ms: int = 30_000
    jitter: float = 0.0
    queueing: bool = False
    churn: bool = False
    system_ends: bool = False


SCENARIOS = (
    Scenario("bench", seed=11, frames=260, population=64),
    Scenario("explore", seed=12, frames=320, population=40, measured_fraction=0.5,
             ttl_ms=150, jitter=0.08, queueing=True, churn=True),
    Scenario("small", seed=13, frames=160, population=5, system_ends=True, churn=True,
             queueing=True),
)


PREFILL_LADDER = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
MIXED_PROMPTS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def catalog() -> tuple[GraphShape, ...]:
    """``flare bench plan``'s catalog (copied here so the fixture never moves with the
    benchmark) plus initialization graphs (multistage prerequisites)."""
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
    shapes += [GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                          state_op=StateOp.INITIALIZE) for b in (1, 2, 4)]
    shapes += [GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                          proposal_depth=w - 1, packed_capacity=b * w,
                          binding=TargetBinding.QUERY_LENGTH)
               for b in BATCHES for w in (2, 3, 4)]
    return tuple(shapes)


def synthetic_duration_ns(shape: GraphShape) -> int:
    """Launch cost plus per-token and per-row costs (as ``flare bench plan``)."""
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


def _f(x: float) -> str:
    return float(x).hex()


def serialise(plan: ScheduledPlan | None, position: dict[GraphShape, int]) -> list[object]:
    """Every decision field of ``plan`` in a fixed order (floats exact)."""
    if plan is None:
        return ["none"]
    mixed = plan.step.mixed
    return [
        position[plan.shape], plan.reason.value, plan.estimated_duration_ns,
        plan.duration_known, plan.stale, plan.requires_empty_window, plan.planned_at_ns,
        plan.start_ns, plan.scale_exponent, _f(plan.scaled_score), _f(plan.useful_value),
        -1 if plan.lookahead_shape is None else position[plan.lookahead_shape],
        None if mixed is None else [mixed.prefill_row, mixed.decode_mode.value],
        [[int(lane.handle), lane.epoch, lane.role.value, lane.prompt_start,
          lane.prompt_tokens, lane.token_ceiling, _f(lane.expected_tokens),
          _f(lane.expected_deliveries), _f(lane.value)] for lane in plan.lanes],
    ]


def digest(data: object) -> str:
    return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()[:20]


def _state(s: Scheduler) -> list[object]:
    out: list[object] = []
    for h in s.handles():
        r = s.request(h)
        z = r.history.delivery_rate
        out.append([int(h), r.epoch, r.phase.value, r.prompt_cursor, r.output_committed,
                    _f(r.history.token_rate), None if z is None else _f(z)])
    st = s.statistics()
    out.append([sorted(st.executions.items()), sorted(st.execution_ns.items()),
                st.committed_plans, st.failed_lanes, _f(st.refresh_credit_ns)])
    return out


def _admit(s: Scheduler, rng: random.Random, sc: Scenario,
           awaiting: list[RequestHandle]) -> None:
    long_prompt = rng.random() < 0.25
    prompt = rng.randint(2000, 30_000) if long_prompt else rng.randint(16, 1500)
    ends = tuple(sorted(rng.sample(range(1, prompt), k=min(3, prompt - 1))))
    system_end = rng.randint(1, prompt) if sc.system_ends and rng.random() < 0.5 else None
    roll = rng.random()
    restore = RestoreNeed.NONE
    stages: tuple[StateOp, ...] = ()
    if roll < 0.05:
        restore = RestoreNeed.READY
    elif roll < 0.08:
        restore, stages = RestoreNeed.READY, (StateOp.INITIALIZE,)
    elif roll < 0.10 and sc.churn:
        restore = RestoreNeed.AWAITING
    h = s.admit(prompt_len=prompt, max_output_tokens=rng.randint(8, 400),
                cached_prefix_len=rng.choice([0, 0, prompt // 2]), message_ends=ends,
                system_end=system_end, scored_prompt=rng.random() < 0.05,
                restore=restore, further_stages=stages)
    if restore is RestoreNeed.AWAITING:
        awaiting.append(h)


def run(sc: Scenario) -> dict[str, object]:
    """Drive one scenario; return the per-plan digests, shapes and a final state digest."""
    rng = random.Random(sc.seed)
    shapes = catalog()
    position = {shape: i for i, shape in enumerate(shapes)}
    s = Scheduler(config=PolicyConfig(estimate_ttl_ns=sc.ttl_ms * MS), catalog=shapes)
    for shape in shapes:
        if rng.random() < sc.measured_fraction:
            s.estimates.observe(shape, synthetic_duration_ns(shape), 1)
    s.advance_to(1)
    awaiting: list[RequestHandle] = []
    in_flight: deque[tuple[Fence, ScheduledPlan, int, int]] = deque()
    digests: list[str] = []
    summary: list[list[object]] = []
    fence = 0
    tail_end = s.now_ns
    for _ in range(sc.frames):
        while len(s.handles()) < sc.population:
            _admit(s, rng, sc, awaiting)
        if sc.churn:
            handles = s.handles()
            if rng.random() < 0.02:
                s.cancel(rng.choice(handles))
            if rng.random() < 0.01:
                s.preempt(rng.choice(handles))
            if awaiting and rng.random() < 0.2:
                h = awaiting.pop(0)
                if h in handles:
                    s.restoration_ready(h)
        plan = s.plan()
        data = serialise(plan, position)
        digests.append(digest(data))
        summary.append([data[0], 0 if plan is None else len(plan.lanes)])
        if plan is not None and s.window_ready(plan):
            fence += 1
            s.commit(plan, Fence(fence))
            duration = synthetic_duration_ns(plan.shape)
            if sc.jitter:
                duration = round(duration * (1.0 + rng.uniform(-sc.jitter, sc.jitter)))
            tail_end = max(tail_end, s.now_ns) + duration
            in_flight.append((Fence(fence), plan, tail_end, duration))
            if sc.queueing and len(in_flight) < 2 and rng.random() < 0.7:
                continue  # plan the next frame while this one runs (projection)
        if not in_flight:
            s.advance_to(s.now_ns + MS)
            continue
        done, done_plan, end, d = in_flight.popleft()
        s.advance_to(max(s.now_ns, end))
        records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                    prompt_tokens=lane.prompt_tokens,
                                    token_ids=(1,) * lane.token_ceiling,
                                    terminated=lane.token_ceiling > 0 and rng.random() < 0.02,
                                    ok=not (sc.churn and rng.random() < 0.003))
                   for lane in done_plan.lanes]
        out = s.complete(done, records, ExecutionTiming(device_intervals_ns=(d,), wall_ns=d))
        for token in out:
            if token.token_ids:
                if sc.churn and rng.random() < 0.1:
                    s.nothing_published(token.handle, token.fence)
                else:
                    s.published_output(token.handle, token.fence, s.now_ns)
        s.take_released()
    return {"digests": digests, "summary": summary, "state": digest(_state(s))}


def generate() -> dict[str, object]:
    return {sc.name: run(sc) for sc in SCENARIOS}


if __name__ == "__main__":
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(generate(), separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE}")
