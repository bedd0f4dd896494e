"""Acceptance estimates and confidence forecasts (seed: Completed confidence and acceptance)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.speculation import (
    INITIAL_WEIGHT,
    MAX_WEIGHT,
    AcceptanceState,
    PopulationPrior,
    PopulationPriors,
    PrefixEstimate,
    ProposalSource,
    expected_output,
    optimistic_bound,
)

LEARNED, COPY = ProposalSource.LEARNED, ProposalSource.COPY


def test_acc_1_expected_output() -> None:
    """Covers ACC-1: W=3, s=(0.5, 0.25) -> 1.75."""
    assert expected_output((0.5, 0.25), width=3, alpha=1.0, limit=100) == 1.75
    # Width bounds the proposals used: W=2 uses s_1 only; W=1 is the pending token alone.
    assert expected_output((0.5, 0.25), width=2, alpha=1.0, limit=100) == 1.5
    assert expected_output((0.5, 0.25), width=1, alpha=1.0, limit=100) == 1.0
    # Missing survival entries count as zero.
    assert expected_output((0.5,), width=4, alpha=1.0, limit=100) == 1.5


def test_acc_2_sel_13_expected_output_bounded_by_limit() -> None:
    """Covers ACC-2, SEL-13: one output token left -> at most 1; two of context -> at most 2."""
    s = (0.9, 0.9, 0.9)
    assert expected_output(s, width=4, alpha=1.0, limit=1) == 1.0
    assert expected_output(s, width=4, alpha=1.0, limit=2) == 2.0
    assert expected_output(s, width=4, alpha=1.0, limit=0) == 0.0


def test_acc_3_alpha_exponent() -> None:
    """Covers ACC-3, POL-10: alpha=2 scores with s_i squared."""
    assert expected_output((0.5, 0.25), width=3, alpha=2.0, limit=10) == 1 + 0.25 + 0.0625
    with pytest.raises(ValueError):
        expected_output((0.5,), width=2, alpha=0.0, limit=10)
    with pytest.raises(ValueError):
        expected_output((0.5,), width=0, alpha=1.0, limit=10)


def test_acc_19_prior_starts_at_half_to_the_d() -> None:
    """Covers ACC-19: a fresh prior at d=3 is 0.125."""
    prior = PopulationPrior()
    assert prior.mean(3) == 0.125
    assert prior.means(4) == (0.5, 0.25, 0.125, 0.0625)


def test_acc_20_prior_moves_one_sixty_fourth() -> None:
    """Covers ACC-20: prior 0.5, observe 1.0 -> 0.5078125."""
    prior = PopulationPrior()
    prior.observe([1.0])
    assert prior.mean(1) == 0.5078125
    assert prior.mean(2) == 0.25  # unobserved depths keep the start


def test_acc_21_initial_weight_two() -> None:
    """Covers ACC-21, OPEN-17: a new estimate reports weight 2 at every depth."""
    estimate = PrefixEstimate()
    assert INITIAL_WEIGHT == 2
    assert [estimate.weight(d) for d in (1, 2, 7)] == [2.0, 2.0, 2.0]


def test_open_17_prior_is_a_pseudo_weight_of_two() -> None:
    """Covers OPEN-17: each observation has weight one against the prior's two."""
    estimate = PrefixEstimate((0.5,))
    estimate.observe([1.0])
    assert estimate.mean(1) == pytest.approx((2 * 0.5 + 1.0) / 3)
    assert estimate.weight(1) == 3.0


def test_acc_22_weight_caps_at_128() -> None:
    """Covers ACC-22: after 500 observations the weight is 128."""
    estimate = PrefixEstimate()
    for _ in range(500):
        estimate.observe([1.0, 0.0])
    assert estimate.weight(1) == MAX_WEIGHT == 128
    assert estimate.weight(2) == 128
    assert estimate.mean(1) > 0.99 and estimate.mean(2) < 0.01


def test_acc_23_weight_halves_over_128_generated_tokens() -> None:
    """Covers ACC-23: ageing by the request's own generated tokens, half-life 128."""
    estimate = PrefixEstimate()
    for _ in range(10):
        estimate.observe([1.0])
    before_mean = estimate.mean(1)
    estimate.age(128)
    assert estimate.weight(1) == pytest.approx(12 / 2)
    assert estimate.weight(2) == pytest.approx(1.0)  # unobserved depths age too
    estimate.age(64)
    assert estimate.weight(1) == pytest.approx(6 / math.sqrt(2))
    assert estimate.mean(1) == before_mean  # ageing never moves a mean


def test_acc_26_optimistic_bound() -> None:
    """Covers ACC-26: mean 0.3 at weight 128 -> 0.40818; mean 0.2 at weight 2 -> 1."""
    assert optimistic_bound(0.3, 128.0) == pytest.approx(0.40818, abs=1e-5)
    assert optimistic_bound(0.2, 2.0) == 1.0
    assert optimistic_bound(0.1, 0.0) == 1.0
    estimate = PrefixEstimate((0.3,))
    assert estimate.optimistic(1) == optimistic_bound(0.3, 2.0)


def test_acc_6_7_accepted_prefix_one_rejection_zero() -> None:
    """Covers ACC-6, ACC-7: offer 4, accept 2 -> depths 1-2 observe 1, depths 3-4 observe 0."""
    state = AcceptanceState()
    state.observe_round(LEARNED, offered=4, accepted=2, terminated=False)
    est = state.acceptance(LEARNED)
    priors = (0.5, 0.25, 0.125, 0.0625)
    for depth, (prior, obs) in enumerate(zip(priors, (1, 1, 0, 0), strict=True), start=1):
        assert est.mean(depth) == pytest.approx((2 * prior + obs) / 3)
        assert est.weight(depth) == 3.0
    assert est.weight(5) == 2.0


def test_acc_8_termination_censors_the_suffix() -> None:
    """Covers ACC-8: a stop at depth 2 of 4 leaves depths 3-4 unchanged."""
    state = AcceptanceState()
    state.observe_round(LEARNED, offered=4, accepted=2, terminated=True)
    est = state.acceptance(LEARNED)
    assert est.weight(1) == est.weight(2) == 3.0
    assert (est.mean(3), est.weight(3)) == (0.125, 2.0)
    assert (est.mean(4), est.weight(4)) == (0.0625, 2.0)


def test_acc_9_width_one_rounds_supply_no_acceptance() -> None:
    """Covers ACC-9: offered 0 (W=1) observes nothing."""
    priors = PopulationPriors()
    state = AcceptanceState(priors)
    state.observe_round(LEARNED, offered=0, accepted=0, terminated=False)
    assert state.acceptance(LEARNED).weight(1) == 2.0
    assert priors.acceptance(LEARNED).mean(1) == 0.5


def test_acc_5_sources_are_tracked_separately() -> None:
    """Covers ACC-5, OPEN-18: learned and copy observations update separate estimates."""
    state = AcceptanceState()
    state.observe_round(COPY, offered=3, accepted=3, terminated=False)
    assert state.acceptance(COPY).weight(1) == 3.0
    assert state.acceptance(LEARNED).weight(1) == 2.0
    assert state.survival(LEARNED, 2) == (0.5, 0.25)


def test_acc_17_forecasts_and_acceptance_are_separate() -> None:
    """Covers ACC-17: a forecast update leaves acceptance unchanged, and vice versa."""
    state = AcceptanceState()
    state.observe_forecast(LEARNED, [0.9, 0.8])
    assert state.acceptance(LEARNED).weight(1) == 2.0
    assert state.survival(LEARNED, 2) == (0.5, 0.25)
    state.observe_round(LEARNED, offered=2, accepted=0, terminated=False)
    assert state.forecast_means(LEARNED, 2) == pytest.approx(
        ((2 * 0.5 + 0.9) / 3, (2 * 0.25 + 0.8) / 3))


def test_acc_18_forecast_starts_from_the_population_prior() -> None:
    """Covers ACC-18, ACC-20, OPEN-17: a new request starts at the population's current prior."""
    priors = PopulationPriors()
    first = AcceptanceState(priors)
    assert first.forecast_means(LEARNED, 3) == (0.5, 0.25, 0.125)
    first.observe_forecast(LEARNED, [1.0, 1.0])
    assert priors.forecast(LEARNED).mean(1) == 0.5078125
    assert priors.forecast(COPY).mean(1) == 0.5  # one prior per source
    assert priors.acceptance(LEARNED).mean(1) == 0.5  # forecasts do not move acceptance
    later = AcceptanceState(priors)
    assert later.forecast_means(LEARNED, 2) == (0.5078125, 0.25 + 0.75 / 64)
    assert later.forecast(LEARNED).weight(1) == 2.0
    # The first request's own forecast is its weighted mean, not the prior.
    assert first.forecast_means(LEARNED, 1) == pytest.approx(((2 * 0.5 + 1.0) / 3,))


def test_acceptance_observations_move_the_acceptance_prior() -> None:
    """OPEN-17 decision: verified acceptance also has a population prior per source."""
    priors = PopulationPriors()
    AcceptanceState(priors).observe_round(COPY, offered=2, accepted=1, terminated=False)
    assert priors.acceptance(COPY).means(2) == (0.5 + 0.5 / 64, 0.25 - 0.25 / 64)
    assert AcceptanceState(priors).survival(COPY, 2) == (0.5 + 0.5 / 64, 0.25 - 0.25 / 64)


def test_acc_24_unobserved_suffix_keeps_its_mean() -> None:
    """Covers ACC-24: observing depths 1-2 leaves the depth-4 mean unchanged."""
    estimate = PrefixEstimate((0.5, 0.4, 0.3, 0.2))
    estimate.observe([1.0, 1.0])
    assert estimate.mean(4) == 0.2 and estimate.weight(4) == 2.0


def test_acc_28_survival_values_replace_binary_observations() -> None:
    """Covers ACC-28: given survival rows are observed instead of 0/1 at their depths."""
    state = AcceptanceState()
    state.observe_round(LEARNED, offered=3, accepted=1, terminated=False,
                        survival=[0.8, 0.4])
    est = state.acceptance(LEARNED)
    assert est.mean(1) == pytest.approx((2 * 0.5 + 0.8) / 3)
    assert est.mean(2) == pytest.approx((2 * 0.25 + 0.4) / 3)
    assert est.mean(3) == pytest.approx((2 * 0.125 + 0.0) / 3)  # binary beyond the rows


def test_acc_25_survival_uses_means_and_is_non_increasing() -> None:
    """Covers ACC-25: ordinary selection reads means (never the optimistic bound)."""
    state = AcceptanceState()
    for _ in range(3):
        state.observe_round(LEARNED, offered=3, accepted=3, terminated=False)
    est = state.acceptance(LEARNED)
    assert state.survival(LEARNED, 2) == (est.mean(1), est.mean(2))
    assert state.optimistic_survival(LEARNED, 2) == (est.optimistic(1), est.optimistic(2))
    assert state.optimistic_survival(LEARNED, 1)[0] > state.survival(LEARNED, 1)[0]
    # Means that cross (depth 2 above depth 1) are clipped by a running minimum.
    odd = AcceptanceState()
    odd.acceptance(COPY).observe([0.2, 0.9])
    assert odd.survival(COPY, 2) == (odd.acceptance(COPY).mean(1),) * 2


def test_request_ageing_reaches_every_estimate() -> None:
    """Covers ACC-23: AcceptanceState.age ages acceptance and forecast estimates."""
    state = AcceptanceState()
    state.observe_round(LEARNED, offered=1, accepted=1, terminated=False)
    state.observe_forecast(COPY, [0.5])
    state.age(256)
    assert state.acceptance(LEARNED).weight(1) == pytest.approx(3 / 4)
    assert state.forecast(COPY).weight(1) == pytest.approx(3 / 4)


def test_invalid_observations_are_rejected() -> None:
    state = AcceptanceState()
    with pytest.raises(ValueError):
        state.observe_round(LEARNED, offered=2, accepted=3, terminated=False)
    with pytest.raises(ValueError):
        state.observe_round(LEARNED, offered=2, accepted=1, terminated=False, survival=[1.2])
    with pytest.raises(ValueError):
        state.observe_forecast(LEARNED, [math.nan])
    with pytest.raises(ValueError):
        PrefixEstimate().age(-1)
    with pytest.raises(ValueError):
        PrefixEstimate().mean(0)


@settings(deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("round"), st.integers(0, 6), st.integers(0, 6), st.booleans()),
    st.tuples(st.just("age"), st.integers(0, 1000), st.integers(0, 0), st.booleans()),
), max_size=60))
def test_estimates_stay_probabilities_with_bounded_weights(
    events: list[tuple[str, int, int, bool]]
) -> None:
    """Property (ACC-21, ACC-22, ACC-23, ACC-24): means stay in [0, 1]; weights stay in [0, 128]."""
    state = AcceptanceState()
    for kind, a, b, terminated in events:
        if kind == "round":
            offered, accepted = max(a, b), min(a, b)
            state.observe_round(LEARNED, offered=offered, accepted=accepted,
                                terminated=terminated)
        else:
            state.age(a)
        est = state.acceptance(LEARNED)
        for depth in range(1, 8):
            assert 0.0 <= est.mean(depth) <= 1.0
            assert 0.0 <= est.weight(depth) <= MAX_WEIGHT
            assert est.mean(depth) <= est.optimistic(depth) <= 1.0
        s = state.survival(LEARNED, 7)
        assert all(x >= y for x, y in itertools.pairwise(s))


def test_open_34_preseeded_acceptance_history() -> None:
    """Covers OPEN-34: a request can start from a given history without moving the prior."""
    priors = PopulationPriors()
    state = AcceptanceState(priors)
    state.preseed(COPY, [0.9, 0.7], weight=64.0)
    assert state.survival(COPY, 3) == (0.9, 0.7, 0.125)
    assert state.acceptance(COPY).weight(1) == 64.0
    assert state.acceptance(COPY).weight(3) == INITIAL_WEIGHT
    assert priors.acceptance(COPY).mean(1) == 0.5
    state.observe_round(COPY, offered=1, accepted=0, terminated=False)
    assert state.acceptance(COPY).mean(1) == pytest.approx(64 * 0.9 / 65)
    with pytest.raises(ValueError):
        PrefixEstimate.preseeded([0.5], weight=0.0)
    with pytest.raises(ValueError):
        PrefixEstimate.preseeded([1.5], weight=2.0)
