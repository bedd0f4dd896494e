"""Remaining ordinary-execution rules through the production scheduler: output age from
publication (SEL-14), terminal value independent of output prices (PRE-40, PRE-52),
queued device intervals (DUR-17) and the mixed contract's policy side (MIX-10, MIX-11,
MIX-22, MIX-37, MIX-42)."""

from __future__ import annotations

import math

import pytest
from selection_setup import make_decoder, make_prompt
from synthetic_catalog import (
    MS,
    Driver,
    decode,
    duration_ns,
    measured_scheduler,
    mixed,
    ordinary_catalog,
    prefill,
    records_for,
    snapshot,
)

from policy import (
    DecodeMode,
    ExecutionTiming,
    Fence,
    GraphKind,
    LaneRole,
    Phase,
    Scheduler,
)
from policy.config import policy_preset
from policy.decision import build_context
from policy.selection import DecisionContext


def context(s: Scheduler) -> DecisionContext:
    return build_context(records={h: s.request(h) for h in s.handles()}, catalog=s._catalog,
                         times=s._shape_times(), config=s.config, queue=s._queue,
                         now_ns=s.now_ns, ttl_ns=s.estimates.ttl_ns, refresh_funded=False)


def test_sel_14_output_age_counts_from_publication_not_completion() -> None:
    """Covers SEL-14, ACCT-18: the frame completes at t1, the client sees the token at
    t2 > t1; A_i at t3 is t3 - t2."""
    s = measured_scheduler((decode(1),))
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=50.0)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    d = duration_ns(decode(1))
    s.advance_to(s.now_ns + d)
    out = s.complete(Fence(1), records_for(plan), ExecutionTiming(device_intervals_ns=(d,),
                                                                  wall_ns=d))
    completed_at = s.now_ns
    published_at = completed_at + 3 * MS
    s.advance_to(published_at)
    s.published_output(h, out[0].fence, published_at)
    later = published_at + 5 * MS
    assert s.request(h).output_age_ns(later) == 5 * MS
    assert s.request(h).output_age_ns(later) != later - completed_at


def test_pre_40_terminal_value_ignores_output_and_delivery_prices() -> None:
    """Covers PRE-40, PRE-44: changing a terminal request's output-token and delivery
    prices leaves its terminal lane value unchanged."""
    s = measured_scheduler((decode(1), snapshot(1)))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=1.0)
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    s.request(h).phase = Phase.TERMINAL
    s.request(h).terminal_since_ns = s.now_ns - 4 * MS
    ctx = context(s)
    before = math.ldexp(float(ctx.terminals.base[0]), ctx.exponent)
    s.request(h).history.token_rate = 0.001
    s.request(h).history.delivery_rate = 0.001
    ctx = context(s)
    assert math.ldexp(float(ctx.terminals.base[0]), ctx.exponent) == pytest.approx(before)


@pytest.mark.parametrize("preset", ["balanced", "throughput"])
def test_pre_52_both_presets_apply_terminal_value_and_urgency(preset: str) -> None:
    """Covers PRE-52, PRE-44: both presets keep terminal_value 256 and
    terminal_age_price 1, and a pending terminal's lane carries its age term."""
    config = policy_preset(preset)
    assert config.terminal_value == 256.0 and config.terminal_age_price == 1.0
    s = measured_scheduler((snapshot(1),), config)
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    s.request(h).phase = Phase.TERMINAL
    s.request(h).terminal_since_ns = s.now_ns - 10 * MS
    ctx = context(s)
    sigma = duration_ns(snapshot(1)) / MS
    raw = math.ldexp(float(ctx.terminals.base[0]), ctx.exponent)
    assert raw == pytest.approx(256.0 + 1.0 * sigma * 10.0)
    plan = s.plan()
    assert plan is not None and plan.lanes[0].role is LaneRole.TERMINAL


def test_dur_17_queued_frame_device_interval_updates_the_estimate() -> None:
    """Covers DUR-17: a frame committed behind another (queued, not isolated) still
    feeds its device interval to the estimate."""
    s = measured_scheduler((decode(1),))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=1.0)
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    second = s.plan()
    assert second is not None and s.window_ready(second)
    s.commit(second, Fence(2))
    d = duration_ns(decode(1))
    s.advance_to(s.now_ns + d)
    s.complete(Fence(1), records_for(first), ExecutionTiming(device_intervals_ns=(d,),
                                                             wall_ns=d))
    queued = d + 2 * MS
    s.advance_to(s.now_ns + queued)
    s.complete(Fence(2), records_for(second),
               ExecutionTiming(device_intervals_ns=(queued,), wall_ns=2 * queued))
    assert s.estimates.samples(decode(1))[-1] == queued


def contention(mixed_ns: int) -> Scheduler:
    cat = {prefill(64): duration_ns(prefill(64)), decode(1): duration_ns(decode(1)),
           mixed(2, 64): mixed_ns}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=10.0)
    make_prompt(s, prompt_len=40, token_rate=1.0)
    return s


def test_mix_10_11_mixed_plan_exposes_prompt_row_mode_and_query_lengths() -> None:
    """Covers MIX-10, MIX-11: a mixed plan names its prompt row and ordinary decode
    mode; every lane has a logical query length >= 0 (prompt tokens, or one decode
    position)."""
    s = contention(3 * MS)
    plan = s.plan()
    assert plan is not None and plan.shape.kind is GraphKind.MIXED
    assert plan.step.mixed is not None
    assert plan.step.mixed.decode_mode is DecodeMode.ORDINARY
    row = plan.step.mixed.prefill_row
    assert plan.lanes[row].role is LaneRole.PROMPT and plan.lanes[row].prompt_tokens == 40
    for lane in plan.lanes:
        length = lane.prompt_tokens if lane.role is LaneRole.PROMPT else lane.token_ceiling
        assert length >= 0
        if lane.role is LaneRole.DECODE:
            assert length == 1


def test_mix_42_measured_durations_decide_mixed_versus_separate() -> None:
    """Covers MIX-42, MIX-18: no static preference: a cheap mixed capture wins, an
    expensive one loses to separate prefill and decode graphs."""
    cheap = contention(3 * MS).plan()
    costly = contention(200 * MS).plan()
    assert cheap is not None and cheap.shape.kind is GraphKind.MIXED
    assert costly is not None and costly.shape.kind is not GraphKind.MIXED


def test_mix_22_prompt_capacity_keys_a_separate_estimate() -> None:
    """Covers MIX-22, DUR-7: mixed shapes differing only in prompt capacity have
    separate cost entries."""
    s = Scheduler(catalog=(mixed(2, 64), mixed(2, 256)))
    s.estimates.observe(mixed(2, 64), 9 * MS, 1)
    assert s.estimates.estimate_ns(mixed(2, 64)) == 9 * MS
    assert s.estimates.estimate_ns(mixed(2, 256)) == 0


def test_mix_37_no_mixed_plan_without_mixed_captures() -> None:
    """Covers MIX-37: with prompts and decoders contending but no mixed shape in the
    catalog, the scheduler never produces a mixed plan."""
    s = measured_scheduler(ordinary_catalog())
    for i in range(3):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=float(i))
        make_prompt(s, prompt_len=300, token_rate=1.0)
    trace = Driver(s).run(60)
    assert trace.plans
    assert all(p.shape.kind is not GraphKind.MIXED and p.step.mixed is None
               for p in trace.plans)
