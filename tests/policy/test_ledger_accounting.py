"""Both exploration ledgers, driven through the public scheduler API only (``advance_to``,
``plan``, ``commit``, completion), on schedulers built as production builds them
(``make_policy``).

- A frame committed into an empty window is isolated: its credit is the larger of its
  device interval and wall time; a frame committed behind another is queued and earns
  its device interval only (REF-3, REF-4, LRN-1). Both ledgers use the same credited time.
- Ledgers use raw physical time: an episode with a readiness delay is charged its raw
  interval, ordinary work earns its raw interval, while the cost model learns the
  readiness-corrected sample (LRN-11, LRN-19, LRN-20, DUR-15, REF-14).
- Discovery runs touch neither ledger (REF-5, LRN-18).
- With both ledgers funded, a timing refresh runs before an acceptance probe (LRN-7).

Completions go through ``_complete`` only.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding import decoding

from policy.baselines.factory import make_policy
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.scheduler import Scheduler
from policy.types import (
    CompletionRecord,
    Fence,
    GeneratedToken,
    RequestHandle,
    ScheduledPlan,
    SelectionReason,
)

MS = 1_000_000
DECODE2 = GraphShape(kind=GraphKind.DECODE, batch_capacity=2, token_capacity=1,
                     packed_capacity=2)
DECODE4 = GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1,
                     packed_capacity=4)


def spec(w: int) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=4 * w,
                      binding=TargetBinding.QUERY_LENGTH)


CATALOG = (DECODE2, DECODE4, spec(1), spec(2), spec(4))


def _complete(s: Scheduler, fence: Fence, plan: ScheduledPlan,
              timing: ExecutionTiming) -> list[GeneratedToken]:
    """Complete ``fence`` with one valid token per lane."""
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                prompt_tokens=lane.prompt_tokens,
                                token_ids=(5,) * max(lane.token_ceiling, 1))
               for lane in plan.lanes]
    return s.complete(fence, records, timing)


def timing(device_ms: float, wall_ms: float | None = None, readiness_ms: float = 0.0
           ) -> ExecutionTiming:
    return ExecutionTiming(device_intervals_ns=(round(device_ms * MS),),
                           wall_ns=round((device_ms if wall_ms is None else wall_ms) * MS),
                           readiness_delay_ns=round(readiness_ms * MS))


def speculative(*, measured: bool = True) -> Scheduler:
    s = make_policy("spec-adaptive", catalog=CATALOG)
    assert isinstance(s, Scheduler) and s.speculation is not None
    s.advance_to(1_000 * MS)
    if measured:
        for shape in CATALOG:
            s.estimates.observe(shape, (10 + shape.token_capacity // 2) * MS, s.now_ns)
    return s


def decoders(s: Scheduler, n: int = 4, *, means: Sequence[float],
             weight: float = 1.0) -> list[RequestHandle]:
    return [decoding(s, means=means, weight=weight) for _ in range(n)]


def ordinary_plan(s: Scheduler) -> ScheduledPlan:
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.ORDINARY
    return plan


def test_queued_and_isolated_frames_credit_both_ledgers_differently() -> None:
    """Covers REF-3, REF-4, LRN-1, OPEN-7: the first frame goes into an empty window
    (isolated, wall 20 ms > device 8 ms: 20 ms credited); the second is committed behind
    it (queued: 8 ms, the wall time ignored). Both ledgers record the same credited
    time and earn their own shares of it."""
    s = speculative()
    decoders(s, means=(0.02, 0.01, 0.0))
    first = ordinary_plan(s)
    s.commit(first, Fence(1))
    second = ordinary_plan(s)
    assert not second.requires_empty_window
    s.commit(second, Fence(2))
    refresh, learning = s.refresh_ledger, s.speculation.learning_ledger
    _complete(s, Fence(1), first, timing(8, wall_ms=20))
    assert refresh.ordinary_ns == learning.ordinary_ns == 20 * MS
    _complete(s, Fence(2), second, timing(8, wall_ms=20))
    assert refresh.ordinary_ns == learning.ordinary_ns == 28 * MS
    assert refresh.balance_ns == refresh.share * 28 * MS
    assert learning.balance_ns == learning.share * 28 * MS


def test_ordinary_credit_is_the_raw_interval() -> None:
    """Covers LRN-20, REF-3, DUR-15, LRN-19: ordinary frames with a 3 ms readiness delay
    on a 12 ms device interval earn the raw 12 ms, isolated (wall 10 ms) or queued;
    the cost model learns the corrected 9 ms."""
    s = speculative()
    decoders(s, means=(0.02, 0.01, 0.0))
    first = ordinary_plan(s)
    s.commit(first, Fence(1))
    second = ordinary_plan(s)
    s.commit(second, Fence(2))
    _complete(s, Fence(1), first, timing(12, wall_ms=10, readiness_ms=3))
    assert s.refresh_ledger.ordinary_ns == s.speculation.learning_ledger.ordinary_ns == 12 * MS
    _complete(s, Fence(2), second, timing(12, wall_ms=30, readiness_ms=3))
    assert s.refresh_ledger.ordinary_ns == s.speculation.learning_ledger.ordinary_ns == 24 * MS
    assert s.estimates.samples(second.shape)[-2:] == (9 * MS, 9 * MS)


def stale_except(s: Scheduler, stale_shape: GraphShape) -> None:
    """Past the freshness interval, every program measured again but ``stale_shape``."""
    s.advance_to(s.now_ns + 31_000 * MS)
    for shape in s.catalog:
        if shape != stale_shape:
            s.estimates.observe(shape, s.estimates.estimate_ns(shape), s.now_ns)


def test_refresh_episode_charges_the_raw_interval() -> None:
    """Covers REF-14, LRN-20, DUR-15: a funded refresh of a stale program runs with a
    4 ms readiness delay on an 11 ms interval (the host's wall clock saw 9 ms): the
    refresh ledger pays the raw 11 ms (not 7, nor 9),
    the acceptance ledger nothing, and the program's cost sample is 7 ms."""
    s = speculative()
    stale_except(s, spec(2))
    decoders(s, means=(0.02, 0.01, 0.0))
    s.refresh_ledger.earn(2_495 * MS)
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.TIMING_REFRESH
    assert plan.shape == spec(2)
    s.commit(plan, Fence(1))
    _complete(s, Fence(1), plan, timing(11, wall_ms=9, readiness_ms=4))
    assert s.refresh_ledger.episodes_ns == 11 * MS
    assert s.refresh_ledger.balance_ns == 5 * MS - 11 * MS
    assert s.speculation.learning_ledger.episodes_ns == 0 and s.speculation.learning_ledger.ordinary_ns == 0
    assert s.estimates.samples(spec(2))[-1] == 7 * MS


def probe_ready() -> Scheduler:
    """Barely informed low-acceptance decoders: the ordinary choice is width one, and
    with full acceptance credit a deeper round is worth probing."""
    s = speculative()
    decoders(s, means=(0.1, 0.01, 0.0), weight=1.0)
    assert ordinary_plan(s).shape.token_capacity == 1
    s.speculation.learning_ledger.earn(495 * MS)
    return s


def test_acceptance_episode_charges_the_raw_interval() -> None:
    """Covers LRN-11, LRN-20, LRN-19: the probe runs 13 ms with a 5 ms readiness stall
    (wall clock 10 ms); the acceptance ledger pays the raw 13 ms, the refresh ledger nothing, and the probed
    program's cost sample is the corrected 8 ms."""
    s = probe_ready()
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.ACCEPTANCE_LEARNING
    s.commit(plan, Fence(1))
    _complete(s, Fence(1), plan, timing(13, wall_ms=10, readiness_ms=5))
    assert s.speculation.learning_ledger.episodes_ns == 13 * MS
    assert s.speculation.learning_ledger.balance_ns == 5 * MS - 13 * MS
    assert s.refresh_ledger.episodes_ns == 0 and s.refresh_ledger.ordinary_ns == 0
    assert s.estimates.samples(plan.shape)[-1] == 8 * MS


def test_isolated_episode_pays_its_wall_time_when_longer() -> None:
    """Covers REF-4, LRN-11: an episode always runs alone; wall 16 ms > device 13 ms."""
    s = probe_ready()
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.ACCEPTANCE_LEARNING
    s.commit(plan, Fence(1))
    _complete(s, Fence(1), plan, timing(13, wall_ms=16))
    assert s.speculation.learning_ledger.episodes_ns == 16 * MS


def test_discovery_touches_neither_ledger() -> None:
    """Covers REF-5, LRN-18, LRN-19, DUR-15: unmeasured programs are discovered first;
    their runs earn and charge nothing in either ledger and count as discovery, while
    their readiness-corrected samples become the estimates."""
    s = speculative(measured=False)
    decoders(s, means=(0.02, 0.01, 0.0))
    fence = 0
    while any(s.estimates.estimate_ns(shape) == 0 for shape in CATALOG):
        plan = s.plan()
        assert plan is not None and plan.reason is SelectionReason.DISCOVERY
        fence += 1
        s.commit(plan, Fence(fence))
        _complete(s, Fence(fence), plan, timing(10, wall_ms=30, readiness_ms=2))
        assert s.estimates.estimate_ns(plan.shape) == 8 * MS
    for ledger in (s.refresh_ledger, s.speculation.learning_ledger):
        assert ledger.ordinary_ns == 0 and ledger.episodes_ns == 0 and ledger.balance_ns == 0
    assert s.statistics().executions["discovery"] == fence > 0


def test_refresh_runs_before_a_funded_probe() -> None:
    """Covers LRN-7, REF-7, REF-13: with both ledgers funded on the production
    speculative scheduler, a stale program (speculative or ordinary) is refreshed first;
    the acceptance ledger stays funded, with no episode opened or charged."""
    for stale_shape in (spec(2), DECODE2):
        s = probe_ready()
        plan = s.plan()
        assert plan is not None and plan.reason is SelectionReason.ACCEPTANCE_LEARNING
        stale_except(s, stale_shape)
        s.refresh_ledger.earn(2_495 * MS)
        assert s.refresh_ledger.funded() and s.speculation.learning_ledger.funded()
        plan = s.plan()
        assert plan is not None and plan.reason is SelectionReason.TIMING_REFRESH
        assert plan.shape == stale_shape
        s.commit(plan, Fence(1))
        assert not s.speculation.learning_ledger.episode_open
        _complete(s, Fence(1), plan, timing(11))
        assert s.speculation.learning_ledger.funded() and s.speculation.learning_ledger.episodes_ns == 0
        assert s.statistics().executions["acceptance_learning"] == 0
