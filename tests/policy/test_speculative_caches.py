"""Memoised reads of acceptance estimates stay exact (``policy/speculation.py``).

Selection reads every decoding request's means, weights and optimistic bounds on every
decision, so ``PrefixEstimate`` memoises those rows and ``PopulationPriors`` shares one
fresh state among requests without history. Every change must show up in the next read.
Covers ACC-19..26.
"""

from __future__ import annotations

import pytest

from policy.speculation import (
    INITIAL_WEIGHT,
    AcceptanceState,
    PopulationPriors,
    PrefixEstimate,
    ProposalSource,
    optimistic_bound,
)

LEARNED = ProposalSource.LEARNED


def test_acc_22_23_memoised_rows_follow_observations_and_ageing() -> None:
    estimate = PrefixEstimate((0.5, 0.25))
    assert estimate.means(2) == (0.5, 0.25)
    assert estimate.weights(2) == (INITIAL_WEIGHT, INITIAL_WEIGHT)
    estimate.observe([1.0])
    assert estimate.means(2) == (pytest.approx((2 * 0.5 + 1.0) / 3), 0.25)
    assert estimate.weights(2) == (3.0, INITIAL_WEIGHT)
    assert estimate.optimistic_bounds(2) == (optimistic_bound(estimate.mean(1), 3.0),
                                             optimistic_bound(0.25, INITIAL_WEIGHT))
    estimate.age(128)
    assert estimate.weights(2) == (1.5, INITIAL_WEIGHT / 2)
    assert estimate.optimistic_bounds(2)[0] == optimistic_bound(estimate.mean(1), 1.5)
    assert estimate.means(3)[2] == 0.125  # another depth limit reads its own row


def test_acc_19_20_fresh_state_is_shared_until_a_prior_moves() -> None:
    priors = PopulationPriors()
    fresh = priors.fresh_state()
    assert priors.fresh_state() is fresh
    assert fresh.survival(LEARNED, 3) == (0.5, 0.25, 0.125)
    observed = AcceptanceState(priors)
    observed.observe_round(LEARNED, offered=2, accepted=2, terminated=False)
    moved = priors.fresh_state()
    assert moved is not fresh
    assert moved.survival(LEARNED, 1)[0] == pytest.approx(0.5 + 0.5 / 64)
    assert moved.survival(LEARNED, 1) == AcceptanceState(priors).survival(LEARNED, 1)
