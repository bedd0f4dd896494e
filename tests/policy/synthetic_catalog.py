"""flare's measured synthetic catalog for policy tests (OPEN-33, VER-1).

The seed's tests run the production selector against "measured synthetic catalogs"; we
record ours here, one duration per shape, with the shape of real hardware: a fixed
launch cost plus a per-token or per-row cost, so larger prefills and batches are more
efficient per token (a throughput knee) yet take longer.

- prefill C in 64..4096:        3.0 ms + 0.02 ms * C           (4096 -> 84.92 ms)
- decode B in 1..64:            8.0 ms + 0.05 ms * B           (B=4 -> 8.2 ms)
- mixed (B in 2,4,8; C in 64, 256, 1024), width one:
                                decode(B) + 0.9 * 0.02 ms * C

The ratios follow a mid-size model on one accelerator: a full 4096-token prefill costs
about ten small-batch decode steps.
- state snapshot B in 1, 4:     1.0 ms + 0.2 ms * B

``drive`` runs the production ``Scheduler`` through plan/commit/complete/publish with
device intervals equal to the recorded durations, so tests assert behaviour of the real
selector, never a copy (VER-1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GeneratedToken,
    GraphKind,
    GraphShape,
    RequestHandle,
    ScheduledPlan,
    Scheduler,
    StateOp,
)
from policy.config import PolicyConfig

MS = 1_000_000
PREFILL_CAPS = (64, 128, 256, 512, 1024, 2048, 4096)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def prefill(c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=c)


def decode(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1,
                      packed_capacity=b)


def mixed(b: int, c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=1,
                      prefill_capacity=c, packed_capacity=c + (b - 1))


def snapshot(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                      state_op=StateOp.SNAPSHOT)


def duration_ns(shape: GraphShape) -> int:
    """The recorded duration of ``shape`` in ns."""
    if shape.kind is GraphKind.PREFILL:
        return round((3.0 + 0.02 * shape.token_capacity) * MS)
    if shape.kind is GraphKind.DECODE:
        return round((8.0 + 0.05 * shape.batch_capacity) * MS)
    if shape.kind is GraphKind.MIXED:
        return round((8.0 + 0.05 * shape.batch_capacity
                      + 0.9 * 0.02 * shape.prefill_capacity) * MS)
    if shape.kind is GraphKind.STATE:
        return round((1.0 + 0.2 * shape.batch_capacity) * MS)
    raise ValueError(shape)


def knee_free_costs(*, prefill_ms: float, decode_ms: float, mixed_token_ms: float
                    ) -> Callable[[GraphShape], int]:
    """Durations without a throughput knee: a prefill costs ``prefill_ms`` plus 0.02 ms
    per token, a decode ``decode_ms`` plus 0.1 ms per row, and a mixed frame its decode
    plus ``mixed_token_ms`` per prompt token, from the first one."""
    def cost(shape: GraphShape) -> int:
        if shape.kind is GraphKind.PREFILL:
            return round((prefill_ms + 0.02 * shape.token_capacity) * MS)
        rows = decode_ms + 0.1 * shape.batch_capacity
        if shape.kind is GraphKind.DECODE:
            return round(rows * MS)
        return round((rows + mixed_token_ms * shape.prefill_capacity) * MS)
    return cost


def ordinary_catalog(*, with_mixed: bool = False, with_snapshot: bool = False
                     ) -> tuple[GraphShape, ...]:
    shapes = [prefill(c) for c in PREFILL_CAPS] + [decode(b) for b in DECODE_BATCHES]
    if with_mixed:
        shapes += [mixed(b, c) for b in (2, 4, 8) for c in (64, 256, 1024)]
    if with_snapshot:
        shapes += [snapshot(1), snapshot(4)]
    return tuple(shapes)


def measured_scheduler(shapes: Iterable[GraphShape], config: PolicyConfig | None = None,
                       durations: Callable[[GraphShape], int] = duration_ns,
                       *, at_ns: int = 1) -> Scheduler:
    """A scheduler whose estimates hold the recorded durations (observed at ``at_ns``)."""
    shapes = tuple(shapes)
    s = Scheduler(config, shapes)
    for shape in shapes:
        s.estimates.observe(shape, durations(shape), at_ns)
    s.advance_to(at_ns)
    return s


def records_for(plan: ScheduledPlan, token: int = 7) -> list[CompletionRecord]:
    """A valid completion for every lane of ``plan``."""
    return [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                             prompt_tokens=lane.prompt_tokens,
                             token_ids=(token,) * lane.token_ceiling)
            for lane in plan.lanes]


@dataclass
class Trace:
    """What a driven run did, for assertions."""

    plans: list[ScheduledPlan] = field(default_factory=list)
    plan_ns: list[int] = field(default_factory=list)
    """When each plan was made."""
    tokens: list[tuple[int, GeneratedToken]] = field(default_factory=list)
    """(publication time ns, token)."""

    def first_output_ns(self, handle: RequestHandle) -> int | None:
        return next((t for t, g in self.tokens if g.handle == handle and g.token_ids), None)

    def output_times(self, handle: RequestHandle) -> list[int]:
        return [t for t, g in self.tokens if g.handle == handle and g.token_ids]


class Driver:
    """Runs the production scheduler one isolated frame at a time.

    ``host_gap_ns``: host time between a completion and the next plan.
    ``publish_late``: a frame's outputs are published only once the next frame is
    committed, as on a server whose delivery path is slower than its planning."""

    def __init__(self, sched: Scheduler,
                 durations: Callable[[GraphShape], int] = duration_ns, *,
                 host_gap_ns: int = 0, publish_late: bool = False) -> None:
        self.sched = sched
        self.durations = durations
        self.host_gap_ns = host_gap_ns
        self.publish_late = publish_late
        self.fence = 0
        self.trace = Trace()
        self._unpublished: list[GeneratedToken] = []

    def step(self) -> ScheduledPlan | None:
        s = self.sched
        s.advance_to(s.now_ns + self.host_gap_ns)
        plan = s.plan()
        if plan is None:
            return None
        self.trace.plan_ns.append(s.now_ns)
        self.fence += 1
        s.commit(plan, Fence(self.fence))
        self._publish(self._unpublished)
        d = self.durations(plan.shape)
        s.advance_to(s.now_ns + d)
        out = s.complete(Fence(self.fence), records_for(plan),
                         ExecutionTiming(device_intervals_ns=(d,), wall_ns=d))
        self._unpublished = out if self.publish_late else []
        if not self.publish_late:
            self._publish(out)
        s.take_released()
        self.trace.plans.append(plan)
        return plan

    def _publish(self, out: list[GeneratedToken]) -> None:
        s = self.sched
        for g in out:
            if g.token_ids:
                s.published_output(g.handle, g.fence, s.now_ns)
                self.trace.tokens.append((s.now_ns, g))

    def run(self, steps: int) -> Trace:
        for _ in range(steps):
            if self.step() is None:
                break
        return self.trace
