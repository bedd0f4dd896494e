"""Rules that had no test of their own: selection by value rate, the scheduler's
ownership of records and completion, whole programs only, bursts as one delivery,
request-local acceptance, one cost sample per speculative frame, configuration before
admission, defaults and presets, and the mixed descriptor's capacities."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
from decoding import decoding
from synthetic_catalog import MS, decode, prefill

from policy import GraphKind, GraphShape, Phase, RequestHandle, Scheduler
from policy.baselines.factory import make_policy
from policy.config import PolicyConfig, policy_preset
from policy.descriptors import DescriptorError, ExecutionTiming, TargetBinding
from policy.round_plans import speculative_lanes
from policy.speculation import AcceptanceState, PopulationPriors, ProposalSource
from policy.types import CompletionRecord, Fence, LaneRole, PolicyError, ScheduledPlan

POLICY = pathlib.Path(__file__).resolve().parents[2] / "policy"


def spec(w: int, b: int = 4) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=b * w,
                      binding=TargetBinding.QUERY_LENGTH)


def decoder(s: Scheduler, *, means: tuple[float, ...] | None = None) -> RequestHandle:
    return decoding(s, means=means)


def measured(s: Scheduler, durations_ms: dict[GraphShape, float]) -> Scheduler:
    s.advance_to(1_000 * MS)
    for shape, ms in durations_ms.items():
        s.estimates.observe(shape, round(ms * MS), s.now_ns)
    return s


def speculative_round() -> tuple[Scheduler, ScheduledPlan]:
    """Four well-accepted decoders on the production speculative scheduler, and the
    speculative round it plans for them."""
    s = measured(make_policy("spec-adaptive", catalog=(decode(4), spec(2), spec(4))),
                 {decode(4): 10.0, spec(2): 11.0, spec(4): 12.0})
    for _ in range(4):
        decoder(s, means=(0.95, 0.9, 0.85))
    plan = s.plan()
    assert plan is not None and plan.shape.kind is GraphKind.SPECULATIVE
    return s, plan


def _complete(s: Scheduler, fence: Fence, plan: ScheduledPlan, tokens: int,
              timing: ExecutionTiming) -> None:
    records = [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                token_ids=(5,) * tokens) for lane in plan.lanes]
    s.complete(fence, records, timing)


def test_cat_1_value_per_millisecond_not_total_value() -> None:
    """Covers CAT-1: decode(2) carries twice the value of prefill(64) (2 x 64 vs 64)
    but takes four times as long; the higher value rate wins."""
    config = PolicyConfig(token_fairness=0.0, delivery_fairness=0.0, decode_age_price=0.0)
    s = measured(Scheduler(config, (prefill(64), decode(2))),
                 {prefill(64): 1.0, decode(2): 4.0})
    s.admit(prompt_len=1000, max_output_tokens=16)
    decoder(s)
    decoder(s)
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(64)
    assert plan.useful_value < 2 * config.output_token_value


def test_cat_4_the_scheduler_owns_records_and_completion() -> None:
    """Covers CAT-4: request records, commit and completion live on ``Scheduler``."""
    s = measured(Scheduler(None, (decode(1),)), {decode(1): 8.0})
    h = decoder(s)
    assert s.request(h).handle == h and s.handles() == (h,)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    assert s.in_flight() == (Fence(1),)
    _complete(s, Fence(1), plan, 1, ExecutionTiming(device_intervals_ns=(8 * MS,),
                                                    wall_ns=8 * MS))
    assert s.in_flight() == () and s.request(h).output_committed == 2


def test_cat_11_spec_32_no_proposal_or_verification_only_work() -> None:
    """Covers CAT-11, SPEC-32: no program family or lane role proposes or verifies
    alone, and a speculative round leaves nothing in flight once it completes (no
    proposal is kept for a later frame)."""
    names = {k.name for k in GraphKind} | {r.name for r in LaneRole}
    assert not {n for n in names if re.search("PROPOS|VERIF|DRAFT", n)}
    s, plan = speculative_round()
    assert all(lane.role is LaneRole.DECODE for lane in plan.lanes)
    s.commit(plan, Fence(1))
    _complete(s, Fence(1), plan, 2, ExecutionTiming(device_intervals_ns=(12 * MS,),
                                                    wall_ns=12 * MS))
    assert s.in_flight() == ()


def _burst(tokens: int) -> tuple[float, float | None]:
    s = measured(make_policy("spec-adaptive", catalog=(spec(4, b=1),)),
                 {spec(4, b=1): 10.0})
    h = decoder(s, means=(0.95, 0.9, 0.85))
    s.request(h).history.delivery_rate = 0.05
    plan = s.plan()
    assert plan is not None and plan.shape == spec(4, b=1)
    assert plan.lanes[0].token_ceiling >= 3
    s.commit(plan, Fence(1))
    _complete(s, Fence(1), plan, tokens, ExecutionTiming(device_intervals_ns=(10 * MS,),
                                                         wall_ns=10 * MS))
    s.published_output(h, Fence(1), s.now_ns)
    hist = s.request(h).history
    return hist.token_rate, hist.delivery_rate


def test_sel_4_a_burst_is_one_delivery() -> None:
    """Covers SEL-4, ACCT-14: a three-token burst and a one-token one update the
    delivery rate identically (one delivery each); only the token rate differs."""
    one, three = _burst(1), _burst(3)
    assert three[1] == one[1] is not None
    assert three[0] > one[0]


def test_sel_12_acceptance_is_request_local() -> None:
    """Covers SEL-12: two requests in one decision with different acceptance histories
    get different survival forecasts; a fresh one gets the population prior."""
    s = Scheduler(None, ())
    recs = []
    for _ in range(3):
        h = decoder(s)
        recs.append(s.request(h))
    states = {recs[0].handle: AcceptanceState(), recs[1].handle: AcceptanceState()}
    states[recs[0].handle].preseed(ProposalSource.LEARNED, (0.9, 0.8), weight=64)
    states[recs[1].handle].preseed(ProposalSource.LEARNED, (0.3, 0.1), weight=64)
    lanes = speculative_lanes(
        recs, histories={}, states=states, priors=PopulationPriors(),
        source=ProposalSource.LEARNED, depth_limit=2, context_room={},
        config=PolicyConfig(), exponent=0, age_slope=0.0, start_ns=s.now_ns)
    assert lanes[0].survival == (0.9, 0.8)
    assert lanes[1].survival == (0.3, 0.1)
    assert lanes[2].survival == (0.5, 0.25)


def test_acc_30_one_sample_per_speculative_frame() -> None:
    """Covers ACC-30, DUR-15: a speculative round (proposal, verification and commit in
    one program) adds exactly one cost sample: its whole interval less the readiness
    delay."""
    s, plan = speculative_round()
    before = {shape: s.estimates.samples(shape) for shape in s.catalog}
    s.commit(plan, Fence(1))
    _complete(s, Fence(1), plan, 1, ExecutionTiming(
        device_intervals_ns=(13 * MS,), wall_ns=14 * MS, readiness_delay_ns=2 * MS))
    for shape in s.catalog:
        added = s.estimates.samples(shape)[len(before[shape]):]
        assert added == ((11 * MS,) if shape == plan.shape else ())


def test_pol_1_configure_policy_before_admission() -> None:
    """Covers POL-1, OPEN-29: a configuration given before the first admission changes
    the scores; after it, configuring is refused."""
    def rate(config: PolicyConfig | None) -> float:
        s = Scheduler(None, (decode(1),))
        if config is not None:
            s.configure_policy(config)
        measured(s, {decode(1): 8.0})
        decoder(s)
        plan = s.plan()
        assert plan is not None
        with pytest.raises(PolicyError):
            s.configure_policy(PolicyConfig())
        return plan.selection_value_rate() * 2.0 ** plan.scale_exponent

    assert rate(PolicyConfig(output_token_value=128.0)) > rate(None)


def test_policy_defaults() -> None:
    """Covers POL-3, POL-7, POL-9, QUEUE-21."""
    c = PolicyConfig()
    assert c.token_fairness == 16.0
    assert c.terminal_age_price == 1.0
    assert c.estimate_ttl_ns == 30_000_000_000
    assert c.checkpoint_extra_work_fraction == 0.05
    assert Scheduler().estimates.ttl_ns == 30_000_000_000


def test_pol_16_pol_17_presets_change_preferences_only() -> None:
    """Covers POL-16, POL-17: both presets keep the same catalog, and the throughput
    preset's chosen round is wider than the balanced one's on the same requests (no
    delivery fairness or age price pulling it towards shorter, more frequent bursts)."""
    shapes = (decode(4), spec(2), spec(4))
    widths = {}
    for name in ("balanced", "throughput"):
        s = make_policy("spec-adaptive", policy_preset(name), catalog=shapes)
        assert s.catalog == shapes
        measured(s, {decode(4): 10.0, spec(2): 14.0, spec(4): 20.0})
        for _ in range(4):
            decoder(s, means=(0.7, 0.5, 0.3))
        plan = s.plan()
        assert plan is not None
        widths[name] = plan.shape.token_capacity
    assert widths == {"balanced": 2, "throughput": 4}
    fields = {f.name for f in dataclasses.fields(PolicyConfig)}
    assert not {f for f in fields if re.search("temperature|top_|sampl|capacit", f)}


def test_mix_1_a_mixed_descriptor_needs_all_three_capacities() -> None:
    """Covers MIX-1: batch rows, decode positions per row and prompt tokens."""
    GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=1,
               prefill_capacity=64, packed_capacity=65)
    with pytest.raises(DescriptorError):
        GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=1,
                   packed_capacity=65)
    with pytest.raises(DescriptorError):
        GraphShape(kind=GraphKind.MIXED, batch_capacity=0, token_capacity=1,
                   prefill_capacity=64, packed_capacity=64)


def test_mix_36_policy_has_no_rollback_logic() -> None:
    """Covers MIX-36: recurrent-state rollback and prompt absorption are the prepared
    model's; nothing in policy/ implements them."""
    for path in POLICY.rglob("*.py"):
        text = path.read_text().lower()
        assert "rollback" not in text and "roll back" not in text, path


def test_pol_11_coefficients_are_never_time_limits() -> None:
    """Covers POL-11: huge age and terminal prices on requests an hour old neither
    expire nor fail anything; the old requests are simply planned (a preference, not a
    deadline)."""
    config = PolicyConfig(decode_age_price=1e6, terminal_age_price=1e6)
    s = measured(Scheduler(config, (decode(4),)), {decode(4): 10.0})
    s.advance_to(3_600_000 * MS)
    handles = [decoder(s) for _ in range(3)]
    for h in handles:
        s.request(h).last_visible_ns = 0
    plan = s.plan()
    assert plan is not None and set(plan.handles()) == set(handles)
    s.commit(plan, Fence(1))
    _complete(s, Fence(1), plan, 1, ExecutionTiming(device_intervals_ns=(10 * MS,),
                                                    wall_ns=10 * MS))
    assert all(s.phase(h) is Phase.DECODE for h in handles)
    assert not any(s.request(h).failed or s.request(h).cancelled for h in handles)
