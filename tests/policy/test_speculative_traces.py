"""Startup traces with speculation (seed: Verification; VER-23, VER-24, VER-25, VER-26).

Five and sixteen 64-token prompts on the measured synthetic catalog plus rectangular
speculative programs, with every round accepting zero, three or seven drafts, from
untrained and preseeded acceptance histories (OPEN-34: ``preseed_acceptance``). The
production speculating ``Scheduler`` runs one isolated frame at a time; device intervals
equal the recorded durations.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from synthetic_catalog import MS, duration_ns, ordinary_catalog

from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.protocol import RoundCompletion, RoundLaneOutcome
from policy.round_search import frontier_allocation
from policy.round_speculation import SpeculationSettings
from policy.scheduler import Scheduler
from policy.speculation import ProposalSource
from policy.types import (
    CompletionRecord,
    Fence,
    LaneRole,
    RequestHandle,
    ScheduledPlan,
    SelectionReason,
)


def speculative(b: int, w: int, binding: TargetBinding = TargetBinding.QUERY_LENGTH
                ) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=b * w, binding=binding)


SPECULATIVE = tuple(speculative(b, w) for b in (1, 2, 4, 8, 16) for w in range(1, 9))
DEVICE = tuple(speculative(b, w, TargetBinding.SPECULATIVE_PREFIX_LIMIT)
               for b in (4, 8) for w in range(1, 9))


def cost_ns(shape: GraphShape) -> int:
    """Recorded durations; a speculative round costs its decode batch plus 0.05 ms per
    extra target row and 0.3 ms per draft position."""
    if shape.kind is GraphKind.SPECULATIVE:
        b, w = shape.batch_capacity, shape.token_capacity
        return round((8.0 + 0.05 * b + 0.05 * b * (w - 1) + 0.3 * shape.proposal_depth) * MS)
    return duration_ns(shape)


class SpeculativeDriver:
    """Runs the scheduler; every speculative lane accepts ``accepted`` drafts."""

    def __init__(self, sched: Scheduler, accepted: int) -> None:
        self.sched = sched
        self.accepted = accepted
        self.fence = 0
        self.times: dict[RequestHandle, list[int]] = {}
        self.plans: list[ScheduledPlan] = []

    def records(self, plan: ScheduledPlan) -> list[CompletionRecord]:
        out = []
        for lane in plan.lanes:
            n = lane.token_ceiling
            if lane.role is LaneRole.DECODE and plan.shape.kind is GraphKind.SPECULATIVE:
                n = min(self.accepted + 1, lane.token_ceiling)
            out.append(CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                        prompt_tokens=lane.prompt_tokens,
                                        token_ids=(7,) * n))
        return out

    def sidecar(self, plan: ScheduledPlan) -> list[list[list[float]]]:
        """Confidence ``[2, B, D]``: drafts within the accepted depth look likely (0.9),
        later ones unlikely (0.1); plane 1 is the joint prefix probability."""
        depth = plan.shape.proposal_depth
        position = [0.9 if d < self.accepted else 0.1 for d in range(depth)]
        joint = [math.prod(position[: d + 1]) for d in range(depth)]
        rows = plan.shape.batch_capacity
        return [[position] * rows, [joint] * rows]

    def run(self, steps: int) -> None:
        s = self.sched
        for _ in range(steps):
            plan = s.plan()
            assert plan is not None
            self.fence += 1
            s.commit(plan, Fence(self.fence))
            d = cost_ns(plan.shape)
            s.advance_to(s.now_ns + d)
            timing = ExecutionTiming(device_intervals_ns=(d,), wall_ns=d)
            device = plan.shape.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT \
                and plan.shape.proposal_depth > 0
            if device:
                sidecar = self.sidecar(plan)
                ceilings = [lane.token_ceiling for lane in plan.lanes]
                rows = frontier_allocation(np.array(sidecar[1][: len(ceilings)]), ceilings,
                                           plan.shape.packed_capacity)
                records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                            token_ids=(7,) * min(self.accepted + 1, r))
                           for lane, r in zip(plan.lanes, rows, strict=True)]
                offered = {lane.handle: r - 1 for lane, r in zip(plan.lanes, rows, strict=True)}
                out = s.complete(Fence(self.fence), records, timing, round=RoundCompletion(
                    lanes=tuple(RoundLaneOutcome(handle=h, proposed=n, evaluated=n,
                                                 accepted=min(self.accepted, n))
                                for h, n in offered.items()),
                    confidence=sidecar))
            else:
                out = s.complete(Fence(self.fence), self.records(plan), timing)
            for g in out:
                if g.token_ids:
                    s.published_output(g.handle, g.fence, s.now_ns)
                    self.times.setdefault(g.handle, []).append(s.now_ns)
            self.plans.append(plan)
            assert s.speculation.learning_ledger.bound_holds()  # LRN-17 at every step


def startup(n: int, accepted: int, preseeded: bool,
            speculative_shapes: tuple[GraphShape, ...] = SPECULATIVE,
            ) -> tuple[Scheduler, SpeculativeDriver, list[RequestHandle]]:
    shapes = ordinary_catalog() + speculative_shapes
    s = Scheduler(catalog=shapes, speculation=SpeculationSettings())
    for shape in shapes:
        s.estimates.observe(shape, cost_ns(shape), 1)
    s.advance_to(1)
    handles = [s.admit(prompt_len=64, max_output_tokens=100_000) for _ in range(n)]
    if preseeded:
        for h in handles:
            s.preseed_acceptance(h, tuple(1.0 if d <= accepted else 0.0 for d in range(1, 8)))
    return s, SpeculativeDriver(s, accepted), handles


@pytest.mark.slow
@pytest.mark.parametrize("preseeded", [False, True])
@pytest.mark.parametrize("accepted", [0, 3, 7])
@pytest.mark.parametrize("n", [5, 16])
def test_ver_23_speculative_startup_traces(n: int, accepted: int, preseeded: bool) -> None:
    """Covers VER-23, VER-24, VER-25, VER-26 with speculation: every 64-token prompt
    delivers its first output within 100 ms, later gaps stay below 150 ms, and after
    another hundred rounds every stream progressed with a spread of at most one
    eight-token burst; the chosen width settles on the accepted depth plus one; the
    acceptance-learning bound ``P <= 0.01/0.99 * O + D`` holds at every step (LRN-17)."""
    s, d, handles = startup(n, accepted, preseeded)
    d.run(100)
    for h in handles:
        times = d.times.get(h, [])
        assert times and times[0] / MS <= 100
    d.run(100)
    for h in handles:
        times = d.times[h]
        assert max(b - a for a, b in itertools.pairwise(times)) / MS < 150
    counts = [s.request(h).output_committed for h in handles]
    assert min(counts) > 0 and max(counts) - min(counts) <= 8
    # The loop settles on the accepted depth: untrained histories get there through
    # funded probes, zero acceptance stays at width one (LRN-3, LRN-4, LRN-5, LRN-6, VER-4).
    settled = {p.shape.token_capacity for p in d.plans[-50:]
               if p.reason is SelectionReason.ORDINARY}
    assert settled == {accepted + 1}


@pytest.mark.slow
@pytest.mark.parametrize("accepted", [0, 3, 7])
def test_ver_23_device_allocated_startup_trace(accepted: int) -> None:
    """Covers VER-23 (untrained, five requests) with device allocation: rounds complete
    with the confidence sidecar (``RoundCompletion``) (QUEUE-3, ACC-18); the
    seed's delivery bounds hold (VER-24, VER-25, VER-26) and the width settles on the accepted
    depth plus one."""
    s, d, handles = startup(5, accepted, False, DEVICE)
    d.run(200)
    for h in handles:
        times = d.times[h]
        assert times[0] / MS <= 100
        assert max(b - a for a, b in itertools.pairwise(times)) / MS < 150
    counts = [s.request(h).output_committed for h in handles]
    assert max(counts) - min(counts) <= 8
    settled = {p.shape.token_capacity for p in d.plans[-50:]
               if p.reason is SelectionReason.ORDINARY}
    assert settled == {accepted + 1}
    if accepted:
        forecast = s.acceptance(handles[0]).forecast(ProposalSource.LEARNED)
        assert forecast.mean(1) > 0.8
