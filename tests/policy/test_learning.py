"""Funded acceptance probes (seed: Funded acceptance learning; ``policy/learning.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from policy.credit_ledgers import CreditLedger, acceptance_learning_ledger
from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.learning import (
    OrdinaryChoice,
    Probe,
    find_probe,
    ordinary_from_plan,
    ordinary_from_round,
    probe_rank_key,
)
from policy.round_table import (
    SpeculativeLane,
    forecast_observation,
    observe_completed_round,
    speculative_lane,
)
from policy.rounds import SpeculationMode, best_round, plan_lanes, round_candidates
from policy.speculation import AcceptanceState, PopulationPriors, ProposalSource
from policy.types import (
    Lane,
    LaneRole,
    RequestHandle,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.utility import value_rate

MS = 1_000_000
HOST = TargetBinding.QUERY_LENGTH
DEVICE = TargetBinding.SPECULATIVE_PREFIX_LIMIT
ADAPTIVE = SpeculationMode.ADAPTIVE


def spec(b: int, d: int, w: int, p: int | None = None, binding: TargetBinding = HOST
         ) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=d, packed_capacity=b * w if p is None else p,
                      binding=binding)


W1, W2, W4 = spec(1, 0, 1), spec(1, 1, 2), spec(1, 3, 4)
CATALOG = [W1, W2, W4]
EST = {W1: 10 * MS, W2: 12 * MS, W4: 16 * MS}


def lane(h: int = 1, *, token: float = 1.0, delivery: float = 0.5, limit: int = 100,
         mean: float = 0.1, weight: float = 1.0) -> SpeculativeLane:
    """Low historical means; the optimistic bound at this weight is 1 (ACC-26)."""
    means = tuple(mean ** d for d in range(1, 4))
    opt = tuple(min(1.0, m + float(np.sqrt(np.log(20) / (2 * weight)))) for m in means)
    return SpeculativeLane(handle=RequestHandle(h), epoch=1, token_value=token,
                           delivery_value=delivery, age_value=0.0, age_slope=0.0,
                           output_limit=limit, context_limit=10**6, survival=means,
                           forecast=means, optimistic=opt, weights=(weight,) * 3)


def funded() -> CreditLedger:
    ledger = acceptance_learning_ledger()
    ledger.earn(495 * MS)
    assert ledger.funded()
    return ledger


def ordinary(lanes: list[SpeculativeLane], est: dict[GraphShape, int] = EST) -> OrdinaryChoice:
    best = best_round(round_candidates(lanes, CATALOG, est, alpha=1.0, waiting=0.0,
                                       mode=ADAPTIVE))
    assert best is not None
    return ordinary_from_round(best)


def probe(lanes: list[SpeculativeLane], *, est: dict[GraphShape, int] = EST,
          shapes: list[GraphShape] = CATALOG, choice: OrdinaryChoice | None = None,
          ledger: CreditLedger | None = None, mode: SpeculationMode = ADAPTIVE,
          refresh_pending: bool = False) -> Probe | None:
    return find_probe(lanes=lanes, shapes=shapes, estimates_ns=est,
                      ordinary=choice if choice is not None else ordinary(lanes),
                      ledger=ledger if ledger is not None else funded(), mode=mode,
                      alpha=1.0, waiting=0.0, refresh_pending=refresh_pending)


def test_lrn_3_probe_offers_a_depth_beyond_the_ordinary_choice() -> None:
    """Covers LRN-3: the probe lane's offered depth is at least the ordinary one + 1;
    nothing is probed when the ordinary choice already offers the deepest program."""
    lanes = [lane()]
    choice = ordinary(lanes)
    assert choice.offered_depth == {RequestHandle(1): 0}  # width one wins on the means
    got = probe(lanes, choice=choice)
    assert got is not None and got.probed == (RequestHandle(1),)
    assert got.candidate.lanes[0].rows - 1 >= 0 + 1
    deepest = OrdinaryChoice(rate=choice.rate, offered_depth={RequestHandle(1): 3})
    assert probe(lanes, choice=deepest) is None


def test_lrn_4_probe_must_beat_the_ordinary_choice_optimistically() -> None:
    """Covers LRN-4, ACC-26: a well-informed low-acceptance lane (optimistic bound only
    0.15 above its mean) is never probed; an uninformed one (bound 1) is."""
    assert probe([lane(weight=128.0)]) is None
    assert probe([lane(weight=1.0)]) is not None
    choice = ordinary([lane()])
    assert choice.rate is not None
    unbeatable = OrdinaryChoice(rate=choice.rate * 10, offered_depth={})
    assert probe([lane()], choice=unbeatable) is None


def test_lrn_5_probe_leaves_future_output() -> None:
    """Covers LRN-5: a request at its last token is never probed; one whose limit equals
    the deep round's ceiling is probed only by a round that leaves it output."""
    assert probe([lane(limit=1)]) is None
    got = probe([lane(limit=4)])
    assert got is not None and got.candidate.shape == W2
    got = probe([lane(limit=5)])
    assert got is not None and got.candidate.shape == W4


def test_lrn_6_rank_by_gain_per_millisecond() -> None:
    """Covers LRN-6: with W=4 at 20 ms its optimistic rate gain is larger than W=2's,
    but W=2's gain per millisecond is higher, so W=2 is probed."""
    est = {W1: 10 * MS, W2: 12 * MS, W4: 20 * MS}
    lanes = [lane()]
    choice = ordinary(lanes, est)
    assert choice.rate == pytest.approx(1.5 / 10)
    r2, r4 = value_rate(2.5, 0.0, 12.0, 0.0), value_rate(4.5, 0.0, 20.0, 0.0)
    assert r4 - choice.rate > r2 - choice.rate
    got = probe(lanes, est=est, choice=choice)
    assert got is not None and got.candidate.shape == W2
    assert got.gain_per_ms == pytest.approx((r2 - choice.rate) / 12.0)
    default = probe(lanes)  # at 16 ms W=4 has the better gain per ms
    assert default is not None and default.candidate.shape == W4


def test_lrn_7_timing_refresh_first() -> None:
    """Covers LRN-7: a pending timing refresh suppresses the probe."""
    assert probe([lane()]) is not None
    assert probe([lane()], refresh_pending=True) is None


def test_lrn_8_one_episode_at_a_time() -> None:
    """Covers LRN-8, LRN-15: no probe while an episode is open, nor until credit is full
    again after it closed in debt."""
    ledger = funded()
    ledger.begin_episode()
    assert probe([lane()], ledger=ledger) is None
    ledger.charge(16 * MS)
    ledger.end_episode()
    assert probe([lane()], ledger=ledger) is None
    ledger.earn(99 * 16 * MS)
    assert probe([lane()], ledger=ledger) is not None
    assert probe([lane()], ledger=acceptance_learning_ledger()) is None


def test_lrn_9_tie_keys_in_order() -> None:
    """Covers LRN-9: equal gains prefer the least-informed added prefix, then the shorter
    execution, then the smaller geometry; each key decides only when earlier ones tie."""
    small, big = spec(1, 3, 4), spec(2, 3, 4)
    assert probe_rank_key(0.2, 9.0, 9, big) < probe_rank_key(0.1, 0.5, 1, small)
    assert probe_rank_key(0.1, 0.5, 9, big) < probe_rank_key(0.1, 1.0, 1, small)
    assert probe_rank_key(0.1, 1.0, 1, big) < probe_rank_key(0.1, 1.0, 2, small)
    assert probe_rank_key(0.1, 1.0, 1, small) < probe_rank_key(0.1, 1.0, 1, big)


def test_lrn_9_least_informed_lane_wins_a_tie() -> None:
    """Covers LRN-9 end to end: two single-lane device cohorts with identical optimistic
    value; the lane whose added depths are less informed is probed."""
    shape = spec(1, 3, 4, binding=DEVICE)
    a = lane(1, token=1.0, delivery=1.0, weight=1.0)   # full 5, pending 2 (total order: first)
    b = lane(2, token=0.5, delivery=3.0, weight=0.5)   # full 5, pending 3.5
    choice = OrdinaryChoice(rate=0.01, offered_depth={})
    got = probe([a, b], shapes=[shape], est={shape: 16 * MS}, choice=choice)
    assert got is not None and got.probed == (RequestHandle(2),)
    assert got.added_weight == 0.5


def test_lrn_9_smaller_geometry_wins_a_tie() -> None:
    """Covers LRN-9 end to end: the same probe on B=1 and B=2 at equal cost -> B=1."""
    b2, b1 = spec(2, 3, 4), spec(1, 3, 4)
    got = probe([lane()], shapes=[b2, b1, W1], est={b2: 16 * MS, b1: 16 * MS, W1: 10 * MS})
    assert got is not None and got.candidate.shape == b1


def test_lrn_10_fixed_width_never_probes() -> None:
    """Covers LRN-10: fixed-width execution with full credit does not probe."""
    assert probe([lane()], mode=SpeculationMode.FIXED) is None


def test_lrn_12_probe_forecast_stops_at_frozen_ceiling() -> None:
    """Covers LRN-12: a completed probe's forecast observation covers min(D, W - 1)
    draft positions of its program."""
    got = probe([lane()], shapes=[W1, spec(1, 5, 4)], est={W1: 10 * MS, spec(1, 5, 4): 16 * MS})
    assert got is not None
    sidecar_row = (0.9, 0.8, 0.7, 0.6, 0.5)
    assert forecast_observation(sidecar_row, got.candidate.shape) == (0.9, 0.8, 0.7)


def test_acc_25_probe_freezes_mean_service() -> None:
    """Covers ACC-25 with ACC-26: the probe is chosen optimistically but the service its
    plan freezes for projection uses the historical means."""
    got = probe([lane()])
    assert got is not None
    assert got.candidate.lanes[0].expected_tokens == 4.0
    assert got.expected.lanes[0].expected_tokens == pytest.approx(1 + 0.1 + 0.01 + 0.001)
    assert got.expected.lanes[0].rows == got.candidate.lanes[0].rows
    assert plan_lanes(got.expected)[0].expected_tokens < 2


def test_ordinary_from_plan_reads_decode_lanes_as_depth_zero() -> None:
    """An ordinary decode winner offers zero drafts to each served request (LRN-3)."""
    plan = ScheduledPlan(
        step=ScheduledStep(shape=GraphShape(kind=GraphKind.DECODE, batch_capacity=1,
                                            token_capacity=1, packed_capacity=1),
                           lanes=(Lane(handle=RequestHandle(1), epoch=1, role=LaneRole.DECODE,
                                       token_ceiling=1),)),
        estimated_duration_ns=MS, scaled_score=0.5, scale_exponent=0, duration_known=True,
        stale=False, reason=SelectionReason.ORDINARY, requires_empty_window=False,
        planned_at_ns=0, start_ns=0, useful_value=0.5)
    got = ordinary_from_plan(plan)
    assert got.rate == 0.5 and got.offered_depth == {RequestHandle(1): 0}


def test_lrn_17_bound_over_a_long_run() -> None:
    """Covers LRN-17 (with LRN-11, LRN-14): probes chosen here and paid by the ledger keep
    ``P <= 0.01/0.99 * O + D`` at every step of a long random run."""
    rng = np.random.default_rng(3)
    ledger = acceptance_learning_ledger()
    probes = 0
    for _ in range(2000):
        ledger.earn(int(rng.integers(1, 20)) * MS)
        got = probe([lane()], ledger=ledger)
        if got is not None:
            probes += 1
            ledger.begin_episode()
            ledger.charge(int(got.candidate.estimate_ns * rng.uniform(0.5, 3.0)))
            ledger.end_episode()
        assert ledger.bound_holds()
    assert probes >= 5


SIM_SHAPES = [spec(b, w - 1, w) for b in (8, 16) for w in range(1, 9)]
SIM_EST = {s: int((4 + 0.05 * s.batch_capacity * s.token_capacity) * MS) for s in SIM_SHAPES}


def accept_loop(n: int, accepted: int, preseeded: bool, *, learn: bool,
                rounds: int) -> list[tuple[int, bool]]:
    """Closed loop over rounds, estimates and probes: every round accepts exactly
    ``accepted`` drafts (fewer when fewer are offered). Returns each round's width and
    whether it was a probe."""
    src = ProposalSource.LEARNED
    priors = PopulationPriors()
    states = [AcceptanceState(priors) for _ in range(n)]
    if preseeded:
        for st in states:
            st.preseed(src, tuple(1.0 if d <= accepted else 0.0 for d in range(1, 8)))
    ledger = funded()
    widths = []
    for _ in range(rounds):
        lanes = [speculative_lane(handle=RequestHandle(i), epoch=1, state=states[i],
                                  source=src, depth_limit=7, token_value=1.0,
                                  delivery_value=0.5, age_value=0.0, age_slope=0.0,
                                  output_limit=10**6, context_limit=10**6)
                 for i in range(n)]
        best = best_round(round_candidates(lanes, SIM_SHAPES, SIM_EST, alpha=1.0,
                                           waiting=0.0, mode=ADAPTIVE))
        assert best is not None
        got = find_probe(lanes=lanes, shapes=SIM_SHAPES, estimates_ns=SIM_EST,
                         ordinary=ordinary_from_round(best), ledger=ledger, mode=ADAPTIVE,
                         alpha=1.0, waiting=0.0, refresh_pending=False) if learn else None
        chosen = got.expected if got is not None else best
        if got is not None:
            ledger.begin_episode()
            ledger.charge(chosen.estimate_ns)
            ledger.end_episode()
        else:
            ledger.earn(chosen.estimate_ns)
        for ln in chosen.lanes:
            offered = ln.rows - 1
            observe_completed_round(states[int(ln.handle)], src, chosen.shape,
                                    joint_prefix=None, offered=offered,
                                    accepted=min(accepted, offered), terminated=False)
            states[int(ln.handle)].age(min(accepted, offered) + 1)
        widths.append((chosen.shape.token_capacity, got is not None))
    return widths


@pytest.mark.parametrize("preseeded", [False, True])
@pytest.mark.parametrize("accepted", [0, 3, 7])
@pytest.mark.parametrize("n", [5, 16])
def test_ver_23_acceptance_loop_finds_the_accepted_depth(n: int, accepted: int,
                                                         preseeded: bool) -> None:
    """Covers VER-23 at the policy level (five and sixteen requests; zero, three and seven
    accepted drafts; untrained and preseeded histories), VER-4, LRN-3, LRN-4, LRN-5, LRN-6, ACC-6, ACC-7,
    ACC-9: the loop settles on width accepted + 1; preseeded histories choose it from
    the first round; untrained ones get there through a funded probe."""
    # An untrained loop needs ~100 rounds of 1% credit for its second probe.
    widths = accept_loop(n, accepted, preseeded, learn=True, rounds=12 if preseeded else 110)
    ordinary = [w for w, probe in widths if not probe]
    assert ordinary[-5:] == [accepted + 1] * 5
    if preseeded:
        assert widths[0] == (accepted + 1, False)


def test_lrn_3_without_probes_an_untrained_request_stays_shallow() -> None:
    """Covers LRN-3/LRN-4's purpose: without probes the untrained seven-draft loop never
    learns that deeper drafts survive and stays below width eight."""
    assert max(w for w, _ in accept_loop(16, 7, False, learn=False, rounds=110)) < 8
