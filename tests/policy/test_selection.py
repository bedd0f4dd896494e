"""The ordinary selector: F-SEL arithmetic, scaling, cohorts, dominance, unknown
durations, prefill work and mixed candidates, against measured synthetic catalogs."""

from __future__ import annotations

import math
import random

import pytest
from selection_setup import exhaustive_options, make_decoder, make_prompt, reference_rate
from synthetic_catalog import (
    MS,
    decode,
    duration_ns,
    measured_scheduler,
    mixed,
    prefill,
)

from policy import Fence, LaneRole, Scheduler, SelectionReason
from policy.config import PolicyConfig
from policy.service import delivery_price, output_token_price, prefill_token_price
from policy.utility import reference_interval_ms, unscaled


def raw_rate(plan: object) -> float:
    return unscaled(plan.selection_value_rate(), plan.scale_exponent)  # type: ignore[attr-defined]


def test_sel_19_hand_computed_two_decoder_score() -> None:
    """Covers SEL-19, SEL-16, SEL-21, SEL-22."""
    s = measured_scheduler((decode(2),))
    a = make_decoder(s, token_rate=2.0, delivery_rate=0.5, age_ms=10.0)
    b = make_decoder(s, token_rate=4.0, delivery_rate=0.25, age_ms=3.0)
    plan = s.plan()
    assert plan is not None and set(plan.handles()) == {a, b}
    cfg, t = s.config, duration_ns(decode(2)) / MS
    sigma = 2 * t / 2  # K=2, only decode[B=2] measured: 2 * T / min(2, 2)
    value = 0.0
    for h, age in ((a, 10.0), (b, 3.0)):
        hist = s.request(h).history
        value += output_token_price(hist, cfg) + delivery_price(hist, cfg)
        value += cfg.decode_age_price * sigma * (age + t)
    expected = value / t - t / 2 * cfg.decode_age_price * 2
    assert raw_rate(plan) == pytest.approx(expected, rel=1e-12)
    assert plan.selection_value_rate() * math.exp(plan.selection_log_scale()) == pytest.approx(
        expected, rel=1e-12)


def test_sel_16_reference_interval_uses_fastest_per_stream_graph() -> None:
    """Covers SEL-15, SEL-16: K=k=4; B=2 at 10 ms and B=4 at 16 ms -> B=4, sigma=16."""
    shapes = [(decode(2), 10 * MS), (decode(4), 16 * MS), (decode(1), 9 * MS)]
    assert reference_interval_ms(shapes, 4) == pytest.approx(16.0)
    assert reference_interval_ms(shapes, 0) is None
    assert reference_interval_ms([], 3) is None


def test_sel_17_prefill_only_requests_do_not_enlarge_k() -> None:
    """Covers SEL-17, SEL-8: a prefill-only request changes neither sigma nor waiting."""
    s = measured_scheduler((decode(1), decode(2), prefill(64)))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=5.0)
    only_decode = s.plan()
    assert only_decode is not None
    s.set_catalog((decode(1), decode(2)))  # keep the prompt from competing
    make_prompt(s, prompt_len=4000, token_rate=1.0)
    with_prompt = s.plan()
    assert with_prompt is not None
    assert raw_rate(with_prompt) == pytest.approx(raw_rate(only_decode), rel=1e-12)


def test_sel_20_huge_prices_stay_finite_with_same_winner() -> None:
    """Covers SEL-20, SEL-22: prices near 1e300 give finite scores, same winner."""
    def build(scale: float) -> Scheduler:
        cfg = PolicyConfig(token_fairness=16.0 * scale, output_token_value=64.0 * scale,
                           delivery_fairness=4.0 * scale, decode_age_price=0.1 * scale,
                           terminal_value=256.0 * scale, terminal_age_price=scale)
        s = measured_scheduler((decode(1), decode(2), decode(4), prefill(256), prefill(64)),
                               cfg)
        for i in range(3):
            make_decoder(s, token_rate=1.0 + i, delivery_rate=0.1 * (i + 1), age_ms=5.0 * i)
        make_prompt(s, prompt_len=700, token_rate=0.5)
        return s

    small, huge = build(1.0).plan(), build(1e298).plan()
    assert small is not None and huge is not None
    assert math.isfinite(huge.selection_value_rate())
    assert huge.selection_log_scale() > 600
    assert (huge.shape, huge.handles()) == (small.shape, small.handles())


def test_sel_23_dur_22_unknown_duration_wins_with_finite_score() -> None:
    """Covers SEL-23, DUR-22, OPEN-13: an unknown candidate beats any measured one."""
    s = measured_scheduler((decode(1), decode(2)))
    s.set_catalog((decode(1), decode(2), decode(4)))  # decode[B=4] never measured
    for i in range(3):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=i)
    plan = s.plan()
    assert plan is not None and plan.shape == decode(4)
    assert plan.reason is SelectionReason.DISCOVERY and not plan.duration_known
    assert math.isfinite(plan.selection_value_rate())
    assert plan.requires_empty_window  # DUR-25


def test_dur_23_unknowns_compete_by_useful_value() -> None:
    """Covers DUR-23: of two unknown candidates the higher useful value wins."""
    s = Scheduler(catalog=(prefill(64), prefill(128)))
    make_prompt(s, prompt_len=100, token_rate=1.0)
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(128)  # 100 tokens beat 64
    assert plan.lanes[0].prompt_tokens == 100


def test_dur_26_lone_cold_request_tries_largest_useful_prefill() -> None:
    """Covers DUR-26, SEL-39: all-unknown catalog, one 3000-token prompt."""
    s = Scheduler(catalog=tuple(prefill(c) for c in (64, 512, 1024, 2048, 4096)))
    s.admit(prompt_len=3000, max_output_tokens=4)
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(4096)
    assert plan.lanes[0].prompt_tokens == 3000


def test_dur_20_larger_unmeasured_prefill_excluded_up_to_endpoint() -> None:
    """Covers DUR-20, DUR-21, OPEN-30: 100 tokens to the message end; an unmeasured
    4096 is excluded when 128 covers them; a measured 4096 still competes."""
    s = Scheduler(catalog=(prefill(128), prefill(4096)))
    s.admit(prompt_len=3000, max_output_tokens=4, message_ends=(100,))
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(128)
    s.estimates.observe(prefill(4096), duration_ns(prefill(4096)), 1)
    s.estimates.observe(prefill(128), 10 * duration_ns(prefill(128)), 1)
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(4096)
    assert plan.lanes[0].prompt_tokens == 3000  # message ends do not cut measured work


def test_sel_40_system_boundary_restricts_prefill() -> None:
    """Covers SEL-40, OPEN-36: no chunk crosses the end of the system prompt."""
    s = measured_scheduler((prefill(4096),))
    s.admit(prompt_len=3000, max_output_tokens=4, system_end=700)
    plan = s.plan()
    assert plan is not None and plan.lanes[0].prompt_tokens == 700


def test_sel_41_tail_earns_only_its_tokens() -> None:
    """Covers SEL-41, VER-3 (padded tail): 4096 graph on a 64-token tail."""
    s = measured_scheduler((prefill(4096),))
    h = make_prompt(s, prompt_len=4096 + 64, token_rate=2.0, cursor=4096)
    plan = s.plan()
    assert plan is not None
    (lane,) = plan.lanes
    assert lane.prompt_tokens == 64 and lane.token_ceiling == 1
    hist, cfg = s.request(h).history, s.config
    value = 64 * prefill_token_price(hist, cfg) + output_token_price(hist, cfg) + \
        delivery_price(hist, cfg)
    t = duration_ns(prefill(4096)) / MS
    assert raw_rate(plan) == pytest.approx(value / t, rel=1e-12)  # SEL-46: no age term


def test_ver_3_fitting_tail_uses_smallest_covering_capacity() -> None:
    """Covers VER-3, SEL-32: a 64-token tail on 64..4096 -> the 64 graph (dominance)."""
    s = measured_scheduler(tuple(prefill(c) for c in (64, 256, 1024, 4096)))
    make_prompt(s, prompt_len=4096 + 64, token_rate=2.0, cursor=4096)
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(64)


def test_sel_47_full_large_prefill_wins_without_decoders() -> None:
    """Covers SEL-47, SEL-42, SEL-43: no decoders, long prompt -> 4096 beats 512."""
    s = measured_scheduler(tuple(prefill(c) for c in (512, 4096)))
    make_prompt(s, prompt_len=10_000, token_rate=1.0)
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(4096)


def test_sel_48_smaller_prefill_wins_near_knee_with_decoders() -> None:
    """Covers SEL-48, SEL-47, CAT-3: near a throughput knee (512 at 4 ms, 4096 at 31 ms)
    the larger prefill wins alone but the smaller one wins while decoders wait."""
    knee = {prefill(512): 4 * MS, prefill(4096): 31 * MS, decode(64): 10 * MS}
    winners = []
    for decoders in (0, 100):
        s = measured_scheduler(tuple(knee), durations=knee.__getitem__)
        s.set_catalog((prefill(512), prefill(4096)))  # decoders only wait
        make_prompt(s, prompt_len=10_000, token_rate=1.0)
        for _ in range(decoders):
            make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
        plan = s.plan()
        assert plan is not None
        winners.append(plan.shape)
    assert winners == [prefill(4096), prefill(512)]


def test_sel_49_age_raises_decoder_value_sel_50_no_deadline() -> None:
    """Covers SEL-49, SEL-50: value rises with A_i; the winner is still the argmax."""
    s = measured_scheduler((decode(1),))
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=1.0)
    rates = []
    for age in (1.0, 10.0, 100.0):
        s.request(h).last_visible_ns = s.now_ns - round(age * MS)
        plan = s.plan()
        assert plan is not None
        rates.append(raw_rate(plan))
    assert rates[0] < rates[1] < rates[2]


def test_sel_31_at_most_64_lanes() -> None:
    """Covers SEL-31: 100 decoders never give a plan above 64 lanes."""
    s = measured_scheduler((decode(64), decode(32)))
    for i in range(100):
        make_decoder(s, token_rate=1.0 + i % 7, delivery_rate=1.0, age_ms=i % 13)
    plan = s.plan()
    assert plan is not None and len(plan.lanes) == 64


def test_sel_32_35_padded_batch_never_chosen_ver_6() -> None:
    """Covers SEL-32, SEL-35, VER-6: 3 decoders on B=4 and B=8; B=8 measured faster is
    still discarded as redundant padding."""
    faster = {decode(4): 6 * MS, decode(8): 3 * MS}
    s = measured_scheduler(tuple(faster), durations=faster.__getitem__)
    for i in range(3):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=i)
    plan = s.plan()
    assert plan is not None and plan.shape == decode(4) and len(plan.lanes) == 3


def test_sel_36_batch_four_with_three_competes_with_batch_two() -> None:
    """Covers SEL-36, SEL-24: the winner between B=4 serving 3 and B=2 serving 2 is
    decided by score alone."""
    for b4_ms, expected in ((5.0, decode(4)), (40.0, decode(2))):
        cat = {decode(2): 5 * MS, decode(4): round(b4_ms * MS)}
        s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
        for i in range(3):
            make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=i)
        plan = s.plan()
        assert plan is not None and plan.shape == expected


def test_sel_25_ver_5_heterogeneous_cohort_equals_brute_force() -> None:
    """Covers SEL-25, VER-5: B=2 over five differently priced decoders."""
    rng = random.Random(5)
    for _ in range(20):
        s = measured_scheduler((decode(2),))
        for _ in range(5):
            make_decoder(s, token_rate=rng.uniform(0.1, 10), age_ms=rng.uniform(0, 50),
                         delivery_rate=rng.choice([None, rng.uniform(0.01, 1)]))
        plan = s.plan()
        assert plan is not None
        best = max(exhaustive_options(s), key=lambda o: o.rate)
        assert set(plan.handles()) == set(best.decoders)
        assert raw_rate(plan) == pytest.approx(best.rate, rel=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_ver_11_mixed_selection_equals_exhaustive_enumeration(seed: int) -> None:
    """Covers VER-11, MIX-18, MIX-19, MIX-20, MIX-21, VER-12: the chosen mixed or
    decode cohort equals the best over every legal cohort of every shape."""
    rng = random.Random(seed)
    shapes = [mixed(b, c) for b in (2, 4) for c in (64, 256)] + [decode(2)]
    s = measured_scheduler(shapes)
    for _ in range(rng.randint(0, 4)):
        make_decoder(s, token_rate=rng.uniform(0.1, 10), age_ms=rng.uniform(0, 80),
                     delivery_rate=rng.choice([None, rng.uniform(0.01, 1)]))
    for _ in range(rng.randint(0 if s.handles() else 1, 3)):
        make_prompt(s, prompt_len=rng.randint(10, 600), token_rate=rng.uniform(0.1, 10))
    plan = s.plan()
    assert plan is not None
    best = max(exhaustive_options(s), key=lambda o: o.rate)
    assert raw_rate(plan) == pytest.approx(best.rate, rel=1e-9)
    prompt_lanes = [lane for lane in plan.lanes if lane.role is LaneRole.PROMPT]
    if prompt_lanes:
        assert plan.step.mixed is not None and plan.step.mixed.prefill_row == 0
        assert prompt_lanes[0].prompt_tokens == min(
            plan.shape.prefill_capacity, s.request(prompt_lanes[0].handle).prompt_len)
    elif plan.step.mixed is not None:
        assert plan.step.mixed.prefill_row == -1


def test_mix_19_prompt_only_mixed_population_is_legal() -> None:
    """Covers MIX-19: a mixed plan with a prompt row and no decoders commits."""
    s = measured_scheduler((mixed(2, 256),))
    make_prompt(s, prompt_len=200, token_rate=1.0)
    plan = s.plan()
    assert plan is not None and plan.step.mixed is not None
    assert [lane.role for lane in plan.lanes] == [LaneRole.PROMPT]
    assert plan.requires_empty_window  # MIX-31
    s.commit(plan, Fence(1))


def test_reference_rate_matches_plan_for_prefill_with_decoders() -> None:
    """Covers SEL-19 with a prefill winner: waiting cost over all active decoders."""
    s = measured_scheduler((prefill(512), decode(1)))
    s.set_catalog((prefill(512),))
    h = make_prompt(s, prompt_len=2000, token_rate=0.5)
    for _ in range(3):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=4.0)
    plan = s.plan()
    assert plan is not None
    assert raw_rate(plan) == pytest.approx(
        reference_rate(s, prefill(512), h, 512, ()), rel=1e-12)
