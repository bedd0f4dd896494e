"""Depth-``(D + 1)`` counterfactuals of learned rounds (``learning.round_observations``):
every lane that verified all its drafts observes one depth more, with survival value
``s_D * beyond``, so the extra depth's mean estimates the unconditional prefix survival
``s_(D+1)`` (ACC-6..8, ACC-28). Observing it only after fully accepted rounds would
estimate ``s_(D+1) / s_D`` instead, which made adaptive selection overrate deep rounds."""

from __future__ import annotations

import random

import pytest

from policy.learning import round_observations
from policy.protocol import RoundLaneOutcome as RoundLane
from policy.speculation import AcceptanceState, ProposalSource
from policy.types import RequestHandle

H = RequestHandle(1)


def _extended(lane: RoundLane) -> tuple[int, tuple[float, ...]]:
    survival, offered = round_observations((lane,), depth_beyond=True)
    return offered[lane.handle], survival[lane.handle]


def test_without_depth_beyond_every_lane_offers_what_it_verified() -> None:
    lane = RoundLane(handle=H, proposed=2, evaluated=2, accepted=2, survival=(0.9, 0.6),
                     beyond=1.0)
    assert round_observations((lane,), depth_beyond=False) == ({H: (0.9, 0.6)}, {H: 2})


def test_a_fully_accepted_lane_observes_beyond_at_one_more_depth() -> None:
    assert _extended(RoundLane(handle=H, proposed=2, evaluated=2, accepted=2, survival=(),
                               beyond=1.0)) == (3, (1.0, 1.0, 1.0))
    assert _extended(RoundLane(handle=H, proposed=2, evaluated=2, accepted=2,
                               survival=(0.9, 0.6), beyond=0.5)) == (3, (0.9, 0.6, 0.3))


def test_a_rejected_lane_observes_zero_at_one_more_depth() -> None:
    """The prefix already failed, so a longer one fails too: the extra depth observes
    zero (binary lanes) or the prefix's survival product times ``beyond`` (sampled)."""
    assert _extended(RoundLane(handle=H, proposed=2, evaluated=2, accepted=1, survival=(),
                               beyond=1.0)) == (3, (1.0, 0.0, 0.0))
    assert _extended(RoundLane(handle=H, proposed=2, evaluated=2, accepted=0,
                               survival=(0.4, 0.1), beyond=0.5)) == (3, (0.4, 0.1, 0.05))


def test_lanes_without_a_row_d_counterfactual_are_left_alone() -> None:
    """No report (-1), or a ceiling that cut the drafts: offered stays as verified."""
    for lane in (RoundLane(handle=H, proposed=2, evaluated=2, accepted=2, survival=()),
                 RoundLane(handle=H, proposed=3, evaluated=1, accepted=1, survival=(),
                           beyond=1.0)):
        assert _extended(lane) == (lane.evaluated, lane.survival)


@pytest.mark.parametrize("acceptance", [0.6, 0.85])
def test_extra_depth_mean_estimates_the_unconditional_survival(acceptance: float) -> None:
    """Depth-two rounds over independent per-position acceptance ``a``: depth three's
    mean converges to ``a**3`` (the survival of a three-draft prefix), not to ``a`` (its
    survival given that the first two held)."""
    rng = random.Random(7)
    state = AcceptanceState()
    for _ in range(3000):
        held = [rng.random() < acceptance for _ in range(3)]
        accepted = 0 if not held[0] else 1 if not held[1] else 2
        lane = RoundLane(handle=H, proposed=2, evaluated=2, accepted=accepted, survival=(),
                         beyond=float(held[2]))
        offered, survival = _extended(lane)
        state.observe_round(ProposalSource.LEARNED, offered=offered, accepted=accepted,
                            terminated=False, survival=survival)
    means = state.acceptance(ProposalSource.LEARNED).means(3)
    assert means[2] == pytest.approx(acceptance ** 3, abs=0.08)
    assert means[2] < acceptance - 0.1
