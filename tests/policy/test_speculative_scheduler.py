"""The Scheduler with complete speculative rounds (``policy/round_speculation.py``)."""

from __future__ import annotations

import pytest

from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.protocol import RoundCompletion, RoundLaneOutcome
from policy.round_speculation import SpeculationSettings
from policy.rounds import SpeculationMode
from policy.scheduler import Scheduler
from policy.speculation import INITIAL_WEIGHT, ProposalSource
from policy.types import (
    CompletionError,
    CompletionRecord,
    Fence,
    LaneRole,
    Phase,
    RequestHandle,
    ScheduledPlan,
    SelectionReason,
)

MS = 1_000_000
HOST, DEVICE = TargetBinding.QUERY_LENGTH, TargetBinding.SPECULATIVE_PREFIX_LIMIT
DECODE4 = GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1,
                     packed_capacity=4)


def spec(w: int, binding: TargetBinding = HOST, b: int = 4) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=b * w, binding=binding)


def scheduler(binding: TargetBinding = HOST, *,
              mode: SpeculationMode = SpeculationMode.ADAPTIVE,
              source: ProposalSource = ProposalSource.LEARNED) -> Scheduler:
    shapes = [DECODE4, spec(1, binding), spec(2, binding), spec(4, binding)]
    s = Scheduler(catalog=shapes, speculation=SpeculationSettings(mode=mode, source=source))
    s.advance_to(1_000 * MS)
    for shape in shapes:
        cost = 10 * MS if shape is DECODE4 else (10 + shape.token_capacity // 2) * MS
        s.estimates.observe(shape, cost, s.now_ns)
    return s


def decoders(s: Scheduler, n: int = 4, *,
             means: tuple[float, ...] | None = None) -> list[RequestHandle]:
    out = []
    for _ in range(n):
        h = s.admit(prompt_len=64, max_output_tokens=500)
        rec = s.request(h)
        rec.phase = Phase.DECODE
        rec.prompt_cursor = 64
        rec.output_committed = 1
        rec.last_visible_ns = s.now_ns - 5 * MS
        if means is not None:
            s.preseed_acceptance(h, means)
        out.append(h)
    return out


def stale_except(s: Scheduler, stale_shape: GraphShape) -> None:
    """Advance past the estimates' freshness (DUR-10) and observe every program again
    except ``stale_shape``, which alone is left stale."""
    s.advance_to(s.now_ns + 31_000 * MS)
    for shape in s.catalog:
        if shape != stale_shape:
            s.estimates.observe(shape, s.estimates.estimate_ns(shape), s.now_ns)


def funded_refresh(s: Scheduler, stale_shape: GraphShape) -> ScheduledPlan:
    """The plan with full refresh credit, after checking that the ordinary plan before
    it does not run ``stale_shape`` (REF-8)."""
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.ORDINARY
    assert plan.shape != stale_shape
    s.refresh_ledger.earn(2_495 * MS)
    plan = s.plan()
    assert plan is not None
    return plan


def timing(ms: int) -> ExecutionTiming:
    return ExecutionTiming(device_intervals_ns=(ms * MS,), wall_ns=ms * MS)


def test_ver_4_scheduler_width_follows_acceptance() -> None:
    """Covers VER-4, SPEC-6, SEL-24 through the scheduler: high acceptance plans the
    widest program; low acceptance keeps width one (ordinary decode or W=1)."""
    for binding in (HOST, DEVICE):
        high = scheduler(binding)
        decoders(high, means=(0.95, 0.9, 0.85))
        plan = high.plan()
        assert plan is not None and plan.shape == spec(4, binding)
        assert plan.reason is SelectionReason.ORDINARY and not plan.requires_empty_window
        low = scheduler(binding)
        decoders(low, means=(0.02, 0.01, 0.0))
        plan = low.plan()
        assert plan is not None and plan.shape.token_capacity == 1


def test_acc_6_acc_7_host_round_updates_acceptance() -> None:
    """Covers ACC-6, ACC-7, SEL-2, QUEUE-47: a host round commits, reserves its rows as
    queued output, and its accepted prefix updates the request's acceptance."""
    s = scheduler()
    hs = decoders(s, means=(0.95, 0.9, 0.85))
    plan = s.plan()
    assert plan is not None and plan.shape == spec(4)
    s.commit(plan, Fence(1))
    assert s.request(hs[0]).queued_outputs == 4
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(7, 8, 9))
               for lane in plan.lanes]
    out = s.complete(Fence(1), records, timing(12))
    assert {t.handle for t in out} == set(hs)
    est = s.acceptance(hs[0]).acceptance(ProposalSource.LEARNED)
    assert est.mean(1) > 0.95 and est.mean(3) < 0.85
    assert s.request(hs[0]).output_committed == 4


def test_acc_9_host_round_observes_only_the_drafts_the_source_supplied() -> None:
    """Covers ACC-6, ACC-9 with copy proposals (``D`` bounds the supplied prefix): in a
    host round of ceiling 4, a lane whose source supplied no draft observes nothing (as
    a width-one round), and one that supplied two observes depths 1-2 only; without
    ``offered`` every lane counts its whole ceiling as offered."""
    def run(offered: bool) -> tuple[list[float], list[float]]:
        s = scheduler()
        hs = decoders(s, n=2, means=(0.95, 0.9, 0.85))
        plan = s.plan()
        assert plan is not None and plan.shape == spec(4)
        s.commit(plan, Fence(1))
        records = [CompletionRecord(handle=hs[0], epoch=plan.lanes[0].epoch, token_ids=(7,)),
                   CompletionRecord(handle=hs[1], epoch=plan.lanes[1].epoch,
                                    token_ids=(7, 8))]
        drafts = {hs[0]: 0, hs[1]: 2}
        # without evaluated counts (no round report) every lane offered its ceiling
        s.complete(Fence(1), records, timing(12), round=RoundCompletion(lanes=tuple(
            RoundLaneOutcome(handle=h, proposed=n, evaluated=n, accepted=n)
            for h, n in drafts.items())) if offered else None)
        source = ProposalSource.LEARNED
        return ([s.acceptance(hs[0]).acceptance(source).mean(d) for d in (1, 2, 3)],
                [s.acceptance(hs[1]).acceptance(source).mean(d) for d in (1, 2, 3)])

    none_supplied, two_supplied = run(offered=True)
    assert none_supplied == pytest.approx([0.95, 0.9, 0.85])  # nothing observed
    assert two_supplied[0] > 0.95 and two_supplied[1] < 0.9
    assert two_supplied[2] == pytest.approx(0.85)  # depth 3 was never proposed
    full_none, full_two = run(offered=False)
    assert full_none[0] < 0.95 and full_two[2] < 0.85


def test_queue_3_device_round_completes_through_packed_round() -> None:
    """Covers QUEUE-3, QUEUE-4, SPEC-22, ACC-13, ACC-28, LRN-12: a device round rejects
    ``complete`` without its confidence sidecar; with it (``RoundCompletion``) the
    scheduler reads the sidecar up to min(D, W - 1) positions and the survival rows."""
    s = scheduler(DEVICE)
    hs = decoders(s, means=(0.95, 0.9, 0.85))
    plan = s.plan()
    assert plan is not None and plan.shape == spec(4, DEVICE)
    assert all(lane.token_ceiling == 4 for lane in plan.lanes)
    s.commit(plan, Fence(1))
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(7, 8))
               for lane in plan.lanes]
    with pytest.raises(CompletionError):
        s.complete(Fence(1), records, timing(12))
    assert s.in_flight() == (Fence(1),)
    sidecar = [[[0.9, 0.8, 0.7]] * 4, [[0.9, 0.72, 0.5]] * 4]
    offered = {lane.handle: 3 for lane in plan.lanes}
    survival = {lane.handle: (0.9, 0.6, 0.2) for lane in plan.lanes}
    with pytest.raises(CompletionError):
        s.complete(Fence(1), records, timing(12), round=RoundCompletion())
    s.complete(Fence(1), records, timing(12), round=RoundCompletion(
        lanes=tuple(RoundLaneOutcome(handle=h, proposed=n, evaluated=n, accepted=1,
                                     survival=survival[h]) for h, n in offered.items()),
        confidence=sidecar))
    state = s.acceptance(hs[0])
    forecast = state.forecast(ProposalSource.LEARNED)
    aged = 0.5 ** (2 / 128)  # two generated tokens age every weight (ACC-23)
    assert forecast.weight(3) == pytest.approx((INITIAL_WEIGHT + 1) * aged)
    assert forecast.weight(4) == pytest.approx(INITIAL_WEIGHT * aged)
    assert forecast.mean(2) == pytest.approx((2 * 0.25 + 0.72) / 3)
    acc = state.acceptance(ProposalSource.LEARNED)
    assert acc.mean(3) == pytest.approx((128 * 0.85 + 0.2) / 129)


def test_lrn_probe_episode_through_the_scheduler() -> None:
    """Covers LRN-3, LRN-8, LRN-11, LRN-13, LRN-21, QUEUE-36: with full acceptance credit
    a barely informed low-acceptance cohort is probed deeper; the probe needs an empty window, opens one
    episode, is charged to the acceptance ledger only, and counts as its own kind."""
    fresh = scheduler()
    for h in decoders(fresh):  # low means, barely informed: optimistic bounds are 1
        fresh.preseed_acceptance(h, (0.1, 0.01, 0.0), weight=1.0)
    ordinary = fresh.plan()
    assert ordinary is not None and ordinary.reason is SelectionReason.ORDINARY
    assert ordinary.shape.token_capacity == 1  # without credit: width one on the means
    fresh.speculation.learning_ledger.earn(495 * MS)
    plan = fresh.plan()
    assert plan is not None and plan.reason is SelectionReason.ACCEPTANCE_LEARNING
    assert plan.requires_empty_window and plan.shape.kind is GraphKind.SPECULATIVE
    assert all(lane.role is LaneRole.DECODE for lane in plan.lanes)
    refresh_before = fresh.refresh_ledger.balance_ns
    fresh.commit(plan, Fence(1))
    assert fresh.speculation.learning_ledger.episode_open
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(5,))
               for lane in plan.lanes]
    fresh.complete(Fence(1), records, timing(13))
    assert not fresh.speculation.learning_ledger.episode_open
    assert fresh.speculation.learning_ledger.balance_ns == 5 * MS - 13 * MS
    assert fresh.refresh_ledger.balance_ns == refresh_before
    assert fresh.statistics().executions["acceptance_learning"] == 1
    nxt = fresh.plan()
    assert nxt is not None and nxt.reason is SelectionReason.ORDINARY  # waits for credit


def test_lrn_10_fixed_mode_never_probes() -> None:
    """Covers LRN-10 through the scheduler."""
    s = scheduler(mode=SpeculationMode.FIXED)
    decoders(s)
    s.speculation.learning_ledger.earn(495 * MS)
    plan = s.plan()
    assert plan is not None and plan.reason is SelectionReason.ORDINARY


def test_lrn_16_idle_clears_acceptance_credit() -> None:
    """Covers LRN-16 (OPEN-8): idle discards positive acceptance credit."""
    s = scheduler()
    s.speculation.learning_ledger.earn(200 * MS)
    assert s.speculation.learning_ledger.balance_ns > 0
    s.advance_to(s.now_ns + MS)
    assert s.speculation.learning_ledger.balance_ns == 0


def test_ref_13_funded_refresh_runs_one_complete_speculative_round() -> None:
    """Covers REF-13, REF-14, REF-8, LRN-13: with full refresh credit a stale speculative
    program displaces the measured winner as one complete round; its interval is charged
    to the refresh ledger only."""
    s = scheduler()
    stale_shape = spec(2)
    stale_except(s, stale_shape)
    decoders(s, means=(0.02, 0.01, 0.0))
    plan = funded_refresh(s, stale_shape)
    assert plan.reason is SelectionReason.TIMING_REFRESH
    assert plan.shape == stale_shape and plan.requires_empty_window
    s.commit(plan, Fence(1))
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(5,))
               for lane in plan.lanes]
    s.complete(Fence(1), records, timing(11))
    assert s.refresh_ledger.balance_ns == 5 * MS - 11 * MS
    assert s.speculation.learning_ledger.balance_ns == 0
    assert not s.estimates.is_stale(stale_shape, s.now_ns)
    assert s.statistics().executions["timing_refresh"] == 1


def test_queue_47_48_queued_round_bounds_the_next_one() -> None:
    """Covers QUEUE-11, QUEUE-47, QUEUE-48, SPEC-25: a speculative round may queue behind
    another; the first round's ceiling is reserved as queued output, so the queued round's
    ceilings fit the output that is left."""
    s = scheduler()
    hs = decoders(s, means=(0.95, 0.9, 0.85))
    for h in hs:
        s.request(h).max_output_tokens = 7  # 1 committed: room 6
    first = s.plan()
    assert first is not None and first.shape == spec(4)
    s.commit(first, Fence(1))
    assert all(s.request(h).output_room == 2 for h in hs)
    second = s.plan()
    assert second is not None and second.shape.kind is GraphKind.SPECULATIVE
    assert not second.requires_empty_window
    assert all(lane.token_ceiling <= 2 for lane in second.lanes)
    s.commit(second, Fence(2))
    assert s.in_flight() == (Fence(1), Fence(2))
    assert all(s.request(h).output_room >= 0 for h in hs)
