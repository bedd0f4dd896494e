"""Smaller selection and lifecycle rules: no lateness cost, no forced oldest request,
price preservation across phase transitions, output limits across queued frames,
malformed mixed completions and independent mixed shape expiry."""

from __future__ import annotations

from selection_setup import make_decoder, make_prompt
from synthetic_catalog import (
    MS,
    Driver,
    decode,
    duration_ns,
    measured_scheduler,
    mixed,
    prefill,
    records_for,
)

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    FinishKind,
    LaneRole,
    Phase,
    SelectionReason,
)
from policy.config import PolicyConfig


def timing(ns: int) -> ExecutionTiming:
    return ExecutionTiming(device_intervals_ns=(ns,), wall_ns=ns)


def test_sel_45_no_prefill_lateness_cost() -> None:
    """Covers SEL-45: at fixed prices a prefill's score ignores how long it waited."""
    s = measured_scheduler((prefill(512),))
    h = make_prompt(s, prompt_len=2000, token_rate=1.0)
    first = s.plan()
    s.advance_to(s.now_ns + 5_000 * MS)
    later = s.plan()
    assert first is not None and later is not None and s.request(h).prompt_cursor == 0
    assert later.selection_value_rate() == first.selection_value_rate()


def test_sel_44_pre_49_no_forced_oldest_request() -> None:
    """Covers SEL-44, PRE-49: the oldest request is not forced into the plan."""
    s = measured_scheduler((decode(1),))
    old = make_decoder(s, token_rate=100.0, delivery_rate=50.0, age_ms=0.0)
    s.request(old).admitted_ns = 0
    s.advance_to(s.now_ns + 10 * MS)
    young = make_decoder(s, token_rate=0.01, delivery_rate=0.01, age_ms=0.0)
    plan = s.plan()
    assert plan is not None and plan.handles() == (young,)


def test_acct_21_phase_transition_preserves_prices() -> None:
    """Covers ACCT-21: finishing the prompt changes only what service changes."""
    s = measured_scheduler((prefill(512), decode(1)))
    h = s.admit(prompt_len=100, max_output_tokens=5)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    d = duration_ns(plan.shape)
    s.advance_to(s.now_ns + d)
    s.complete(Fence(1), records_for(plan), timing(d))
    assert s.phase(h) is Phase.DECODE
    snapshot = s.request(h).history.copy()
    s.set_catalog((prefill(512), decode(1), decode(2)))  # normaliser-relevant change
    assert s.request(h).history == snapshot


def test_queue_48_output_limit_across_queued_frames() -> None:
    """Covers QUEUE-47, QUEUE-48: a lane with one token left is not queued twice."""
    s = measured_scheduler((decode(1),))
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0, max_output_tokens=2)
    plan = s.plan()
    assert plan is not None and plan.handles() == (h,)
    s.commit(plan, Fence(1))
    assert s.request(h).output_room == 0
    assert s.plan() is None
    s.advance_to(s.now_ns + duration_ns(decode(1)))
    out = s.complete(Fence(1), records_for(plan), timing(duration_ns(decode(1))))
    assert out[0].finish is FinishKind.LENGTH


def test_ver_14_malformed_mixed_completion_fails_only_the_prompt_row() -> None:
    """Covers VER-14, MIX-26, MIX-27: a prompt row reporting the wrong extent fails; the
    decoder rows of the same mixed frame commit."""
    s = measured_scheduler((mixed(4, 256),))
    decs = [make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=1.0) for _ in range(2)]
    p = make_prompt(s, prompt_len=200, token_rate=0.5)
    plan = s.plan()
    assert plan is not None and plan.step.mixed is not None and plan.step.mixed.prefill_row == 0
    s.commit(plan, Fence(1))
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                prompt_tokens=lane.prompt_tokens - (lane.role is LaneRole.PROMPT),
                                token_ids=(4,) * lane.token_ceiling)
               for lane in plan.lanes]
    d = duration_ns(plan.shape)
    s.advance_to(s.now_ns + d)
    out = {g.handle: g for g in s.complete(Fence(1), records, timing(d))}
    assert out[p].finish is FinishKind.ERROR and s.request(p).prompt_cursor == 0
    for h in decs:
        assert out[h].token_ids == (4,) and s.request(h).output_committed == 2


def test_ver_15_independent_mixed_shape_expiry() -> None:
    """Covers VER-15, VER-9: one mixed shape goes stale while another stays fresh; the
    stale one keeps its cost for ranking and recovers through a refresh."""
    cfg = PolicyConfig(estimate_ttl_ns=100 * MS)
    s = measured_scheduler((mixed(2, 64), mixed(4, 64)), cfg)
    s.advance_to(s.now_ns + 150 * MS)
    s.estimates.observe(mixed(4, 64), duration_ns(mixed(4, 64)), s.now_ns)
    assert s.estimates.is_stale(mixed(2, 64), s.now_ns)
    assert not s.estimates.is_stale(mixed(4, 64), s.now_ns)
    assert s.estimates.estimate_ns(mixed(2, 64)) == duration_ns(mixed(2, 64))
    for _ in range(3):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    s.refresh_ledger.earn(2_495 * MS)
    d = Driver(s)
    plan = d.step()
    assert plan is not None and plan.reason is SelectionReason.TIMING_REFRESH
    assert plan.shape == mixed(2, 64)
    assert not s.estimates.is_stale(mixed(2, 64), s.now_ns)
