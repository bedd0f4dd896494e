"""Speculative round candidates (seed: Speculative graph coverage, Useful service and
selection, Completed confidence and acceptance; module ``policy/rounds.py``)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from gpu.speculative.allocation import reference_allocation
from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.round_cohorts import device_cohort_values
from policy.round_search import best_lengths
from policy.round_table import (
    Ordering,
    RoundCandidate,
    SpeculativeLane,
    forecast_observation,
    lane_ceiling,
    observe_completed_round,
    queued_advance_bound,
    speculative_lane,
)
from policy.rounds import (
    SpeculationMode,
    best_round,
    frontier_allocation,
    plan_lanes,
    round_candidates,
)
from policy.speculation import INITIAL_WEIGHT, AcceptanceState, ProposalSource, expected_output
from policy.types import RequestHandle
from policy.utility import value_rate

MS = 1_000_000
HOST = TargetBinding.QUERY_LENGTH
DEVICE = TargetBinding.SPECULATIVE_PREFIX_LIMIT
FIXED, ADAPTIVE = SpeculationMode.FIXED, SpeculationMode.ADAPTIVE


def spec(b: int, d: int, w: int, p: int | None = None, binding: TargetBinding = HOST
         ) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=d, packed_capacity=b * w if p is None else p,
                      binding=binding)


def lane(h: int, *, token: float = 1.0, delivery: float = 0.5, age: float = 0.0,
         slope: float = 0.0, limit: int = 1000, context: int = 10**6,
         survival: tuple[float, ...] = (0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.02),
         forecast: tuple[float, ...] = (), weights: tuple[float, ...] = ()
         ) -> SpeculativeLane:
    return SpeculativeLane(handle=RequestHandle(h), epoch=1, token_value=token,
                           delivery_value=delivery, age_value=age, age_slope=slope,
                           output_limit=limit, context_limit=context, survival=survival,
                           forecast=forecast, weights=weights)


def lane_value(ln: SpeculativeLane, rows: int, alpha: float, t_ms: float) -> float:
    """Reference lane value, written from the seed's formulas (ACC-1, ACC-2, ACC-3, SEL-19)."""
    if rows == 0:
        return 0.0
    e = 1.0 + sum(s**alpha for s in ln.survival[: rows - 1])
    e = min(e, ln.request_limit)
    return ln.token_value * e + ln.delivery_value + ln.age_value + ln.age_slope * t_ms


def only(shape: GraphShape, lanes: list[SpeculativeLane], mode: SpeculationMode,
         t_ns: int = 10 * MS, alpha: float = 1.0) -> RoundCandidate:
    cands = round_candidates(lanes, [shape], {shape: t_ns}, alpha=alpha, waiting=0.0,
                             mode=mode, keep_dominated=True)
    best = best_round(cands)
    assert best is not None
    return best


def random_lanes(rng: np.random.Generator, n: int) -> list[SpeculativeLane]:
    out = []
    for h in range(n):
        s = tuple(float(x) for x in np.minimum.accumulate(rng.uniform(0, 1, 7)))
        out.append(lane(h, token=float(rng.uniform(0.1, 3)), delivery=float(rng.uniform(0, 3)),
                        age=float(rng.uniform(0, 2)), slope=float(rng.uniform(0, 0.05)),
                        limit=int(rng.integers(1, 6)), survival=s,
                        forecast=tuple(float(x) for x in rng.uniform(0, 1, 7))))
    return out


def test_spec_25_lane_ceiling() -> None:
    """Covers SPEC-25: D=5, W=6, request limit 2 -> ceiling 2; otherwise min(D+1, W)."""
    assert lane_ceiling(spec(4, 5, 6), 2) == 2
    assert lane_ceiling(spec(4, 5, 6), 100) == 6
    assert lane_ceiling(spec(4, 3, 6), 100) == 4
    assert lane_ceiling(spec(4, 0, 1), 100) == 1
    assert lane_ceiling(spec(4, 3, 4), 0) == 0


def test_acc_1_acc_2_expected_output_in_candidates() -> None:
    """Covers ACC-1 (1 + s_1 + s_2 at W=3), ACC-2 and SEL-13 (bounded by output limit
    and context), ACC-3 (alpha = 2 squares each s_i)."""
    shape = spec(1, 2, 3)
    s = (0.5, 0.25, 0.1)
    assert only(shape, [lane(1, survival=s)], ADAPTIVE).lanes[0].expected_tokens == 1.75
    got = only(shape, [lane(1, survival=s)], ADAPTIVE, alpha=2.0).lanes[0].expected_tokens
    assert got == pytest.approx(1 + 0.25 + 0.0625)
    limited = only(shape, [lane(1, survival=(1.0, 1.0), limit=1)], ADAPTIVE).lanes[0]
    assert limited.expected_tokens == 1.0 and limited.rows == 1
    ctx = only(shape, [lane(1, survival=(1.0, 1.0), context=2)], ADAPTIVE).lanes[0]
    assert ctx.expected_tokens == 2.0 and ctx.rows == 2


def test_acc_3_alpha_changes_the_width_choice() -> None:
    """Covers ACC-3: raising s_i to alpha = 2 makes the wider program lose."""
    narrow, wide = spec(1, 0, 1), spec(1, 2, 3)
    est = {narrow: 10 * MS, wide: 20 * MS}
    lanes = [lane(1, token=1.0, delivery=0.0, survival=(0.7, 0.49))]
    pick = {a: best_round(round_candidates(lanes, [narrow, wide], est, alpha=a, waiting=0.0,
                                           mode=ADAPTIVE)) for a in (1.0, 2.0)}
    assert pick[1.0] is not None and pick[1.0].shape == wide
    assert pick[2.0] is not None and pick[2.0].shape == narrow


def test_sel_26_fixed_host_allocation_keeps_complete_prefixes() -> None:
    """Covers SEL-26: fixed W=4, every lane gets 4 rows except one limited to 2."""
    lanes = [lane(1), lane(2), lane(3, limit=2), lane(4)]
    got = only(spec(4, 3, 4), lanes, FIXED)
    assert sorted((int(ln.handle), ln.rows) for ln in got.lanes) == [
        (1, 4), (2, 4), (3, 2), (4, 4)]
    assert [ln.token_ceiling for ln in plan_lanes(got)] == [ln.rows for ln in got.lanes]


@pytest.mark.parametrize("seed", range(40))
def test_sel_27_constrained_ragged_equals_brute_force(seed: int) -> None:
    """Covers SEL-27, SEL-26: fixed allocation on a ragged program picks the highest-value
    cohort fitting both B and P (exhaustive enumeration of cohorts)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    b = int(rng.choice([1, 2, 4]))
    w = int(rng.integers(2, 5))
    p = int(rng.integers(b, b * w + 1))
    shape, t_ms = spec(b, w - 1, w, p), 7.0
    lanes = random_lanes(rng, n)
    ceil = [lane_ceiling(shape, ln.request_limit) for ln in lanes]
    best: float | None = None
    for k in range(1, b + 1):
        for cohort in itertools.combinations(range(n), k):
            if sum(ceil[i] for i in cohort) <= p:
                value = sum(lane_value(lanes[i], ceil[i], 1.0, t_ms) for i in cohort)
                best = value if best is None else max(best, value)
    cands = round_candidates(lanes, [shape], {shape: int(t_ms * MS)}, alpha=1.0,
                             waiting=0.0, mode=FIXED)
    if best is None:  # no complete prefix fits P: the program has no fixed candidate
        assert cands == []
        return
    got = cands[0]
    assert got.base + got.slope * t_ms == pytest.approx(best)
    assert len(got.lanes) <= b and got.rows_used <= p
    assert all(ln.rows == ln.ceiling for ln in got.lanes)


@pytest.mark.parametrize("seed", range(40))
def test_spec_19_adaptive_host_lengths_equal_brute_force(seed: int) -> None:
    """Covers SPEC-19 (host lengths fit P), SPEC-21 (fixed in the plan), SEL-25 (top-B
    when P does not bind): the chosen cohort and lengths maximise value (exhaustive)."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 6))
    b = int(rng.choice([1, 2, 4]))
    w = int(rng.integers(2, 5))
    p = int(rng.integers(b, b * w + 1))
    shape, t_ms = spec(b, w - 1, w, p), 5.0
    lanes = random_lanes(rng, n)
    got = only(shape, lanes, ADAPTIVE, t_ns=int(t_ms * MS))
    ceil = [lane_ceiling(shape, ln.request_limit) for ln in lanes]
    best = 0.0
    for rows in itertools.product(*[range(c + 1) for c in ceil]):
        if sum(r > 0 for r in rows) <= b and sum(rows) <= p:
            value = sum(lane_value(ln, r, 1.0, t_ms) for ln, r in zip(lanes, rows, strict=True))
            best = max(best, value)
    assert got.base + got.slope * t_ms == pytest.approx(best)
    assert got.rows_used <= p and len(got.lanes) <= b
    assert [ln.token_ceiling for ln in plan_lanes(got)] == [ln.rows for ln in got.lanes]


def test_spec_20_host_lengths_follow_acceptance() -> None:
    """Covers SPEC-20: with P binding, the lane with better acceptance gets the rows;
    swapping the histories swaps the lengths."""
    hi, lo = (0.9, 0.8, 0.7), (0.2, 0.1, 0.05)
    shape = spec(2, 3, 4, 5)

    def rows(s1: tuple[float, ...], s2: tuple[float, ...]) -> dict[int, int]:
        got = only(shape, [lane(1, survival=s1), lane(2, survival=s2)], ADAPTIVE)
        return {int(ln.handle): ln.rows for ln in got.lanes}

    assert rows(hi, lo) == {1: 4, 2: 1}
    assert rows(lo, hi) == {1: 1, 2: 4}


@pytest.mark.parametrize("seed", range(30))
def test_spec_28_frontier_allocation_matches_device_reference(seed: int) -> None:
    """Covers SPEC-28, SPEC-29: the host's pricing allocation equals the device rule."""
    rng = np.random.default_rng(seed)
    m, d = int(rng.integers(1, 6)), int(rng.integers(0, 5))
    probs = np.round(np.minimum.accumulate(rng.uniform(0, 1, (m, d)), axis=1), 1)
    ceilings = [int(c) for c in rng.integers(1, d + 2, m)]
    total = int(rng.integers(m, m * (d + 1) + 1))
    assert frontier_allocation(probs, ceilings, total) == reference_allocation(
        probs.tolist(), ceilings, total)


def test_sel_29_device_cohort_priced_with_its_allocation() -> None:
    """Covers SEL-29, SPEC-26, SPEC-30: a device candidate's rows come from the frontier
    rule on forecasts (not ceilings, not prices); ceilings may sum above P."""
    shape = spec(2, 3, 4, 5, DEVICE)
    a = lane(1, token=1.0, delivery=200.0, survival=(1.0, 1.0, 1.0), forecast=(0.9, 0.8, 0.7))
    b = lane(2, token=50.0, survival=(1.0, 1.0, 1.0), forecast=(0.3, 0.2, 0.1))
    got = only(shape, [a, b], ADAPTIVE)
    rows = {int(ln.handle): ln.rows for ln in got.lanes}
    assert rows == {1: 4, 2: 1}  # the richer lane does not buy rows: forecasts decide
    assert sum(ln.ceiling for ln in got.lanes) == 8 > shape.packed_capacity
    assert got.base == pytest.approx(lane_value(a, 4, 1.0, 0) + lane_value(b, 1, 1.0, 0))
    assert [ln.token_ceiling for ln in plan_lanes(got)] == [4, 4]


def test_sel_28_only_value_per_row_ordering_finds_the_best_cohort() -> None:
    """Covers SEL-28: total lane value and pending delivery value both rank A first,
    but the best cohort {X, Y} is a prefix only of the value-per-row ordering."""
    shape = spec(2, 3, 4, 3, DEVICE)
    a = lane(0, token=2.0, delivery=3.0, survival=(1.0, 1.0, 1.0), forecast=(1.0, 1.0, 1.0))
    x = lane(1, token=4.0, delivery=0.0, limit=2, survival=(1.0,), forecast=(0.5,))
    y = lane(2, token=4.0, delivery=0.0, limit=2, survival=(1.0,), forecast=(0.5,))
    lanes = [a, x, y]
    got = only(shape, lanes, ADAPTIVE)
    assert {int(ln.handle) for ln in got.lanes} == {1, 2}
    assert got.ordering is Ordering.VALUE_PER_ROW
    # Brute force over every cohort fitting B, priced with its own allocation.
    best = 0.0
    for k in (1, 2):
        for cohort in itertools.combinations(lanes, k):
            fc = np.array([list(c.forecast[:3]) + [0.0] * (3 - len(c.forecast[:3]))
                           for c in cohort])
            ceil = [lane_ceiling(shape, c.request_limit) for c in cohort]
            rows = frontier_allocation(fc, ceil, 3)
            value = sum(lane_value(c, r, 1.0, 0) for c, r in zip(cohort, rows, strict=True))
            best = max(best, value)
    assert got.base == pytest.approx(best) == 12.0


def test_sel_30_device_search_is_bounded() -> None:
    """Covers SEL-30: the device search prices three orderings times at most min(B, P)
    cohort prefixes (never every cohort), and its best is the chosen candidate."""
    rng = np.random.default_rng(7)
    lanes = random_lanes(rng, 40)
    shape = spec(8, 3, 4, 12, DEVICE)
    values = device_cohort_values(lanes, shape, estimate_ns=MS, alpha=1.0)
    assert values.shape == (3, 8)
    cands = round_candidates(lanes, [shape], {shape: MS}, alpha=1.0, waiting=0.0,
                             mode=ADAPTIVE, keep_dominated=True)
    assert len(cands) == 1
    assert cands[0].base + cands[0].slope * 1.0 == pytest.approx(values.max())
    every = round_candidates(lanes, [shape], {shape: MS}, alpha=1.0, waiting=0.0,
                             mode=ADAPTIVE, keep_dominated=True, every_cohort=True)
    assert 8 <= len(every) <= 3 * 8
    assert len({c.logical_key() for c in every}) == len(every)


def test_ver_4_width_rises_with_acceptance() -> None:
    """Covers VER-4 (high- and low-acceptance speculation), SPEC-6 and SEL-24: width one
    wins at low acceptance, the widest program at high acceptance, and the chosen width
    never falls as acceptance rises (host and device allocation)."""
    for binding in (HOST, DEVICE):
        shapes = [spec(4, 0, 1, 4, binding)] + [spec(4, w - 1, w, None, binding)
                                                for w in (2, 4, 8)]
        est = {s: (10 + 1 * s.token_capacity) * MS for s in shapes}
        widths = []
        for q in (0.02, 0.3, 0.6, 0.9, 0.99):
            lanes = [lane(h, token=4.0, delivery=1.0, age=1.0, slope=0.01,
                          survival=tuple(q ** d for d in range(1, 8)),
                          forecast=tuple(q ** d for d in range(1, 8))) for h in range(4)]
            best = best_round(round_candidates(lanes, shapes, est, alpha=1.0, waiting=0.04,
                                               mode=ADAPTIVE))
            assert best is not None
            widths.append(best.shape.token_capacity)
        assert widths[0] == 1 and widths[-1] == 8
        assert widths == sorted(widths)


def test_spec_6_sel_24_every_batch_and_width_competes() -> None:
    """Covers SPEC-6, SEL-24, SEL-36: every loaded B and W (width one included) yields a
    candidate; a batch-four program serving three competes with batch two serving two."""
    shapes = [spec(b, w - 1, w) for b in (2, 4) for w in (1, 2, 3)]
    est = {s: (5 + s.batch_capacity + s.token_capacity) * MS for s in shapes}
    lanes = [lane(1), lane(2), lane(3)]
    cands = round_candidates(lanes, shapes, est, alpha=1.0, waiting=0.0, mode=ADAPTIVE)
    got = {(c.shape.batch_capacity, c.shape.token_capacity) for c in cands}
    assert got == {(b, w) for b in (2, 4) for w in (1, 2, 3)}
    assert {len(c.lanes) for c in cands if c.shape.batch_capacity == 4} == {3}


def test_sel_34_dominance_keeps_different_depths() -> None:
    """Covers SEL-34, SEL-32, SEL-35: the same cohort and rows at D=3 and D=5 are both
    kept; the same work on a larger batch (even measured faster) is dropped."""
    d3, d5, d3_b8 = spec(4, 3, 6), spec(4, 5, 6), spec(8, 3, 6)
    est = {d3: 10 * MS, d5: 12 * MS, d3_b8: 5 * MS}
    lanes = [lane(h, limit=2) for h in range(3)]  # ceilings 2 at every depth
    cands = round_candidates(lanes, [d3, d5, d3_b8], est, alpha=1.0, waiting=0.0,
                             mode=ADAPTIVE)
    assert {c.shape for c in cands} == {d3, d5}
    assert cands[0].logical_key()[2] == cands[1].logical_key()[2]


def test_spec_31_complete_program_is_priced() -> None:
    """Covers SPEC-31: a candidate using 3 of P=8 rows is scored over the whole
    program's estimate, unused rows included."""
    shape = spec(2, 3, 4, 8)
    ln = lane(1, token=2.0, delivery=1.0, age=0.5, slope=0.1, limit=3,
              survival=(0.5, 0.5, 0.5))
    got = only(shape, [ln], ADAPTIVE, t_ns=40 * MS)
    assert got.rows_used == 3
    e = expected_output(ln.survival, width=3, alpha=1.0, limit=3)
    assert got.rate == pytest.approx(value_rate(2.0 * e + 1.5, 0.1, 40.0, 0.0))


def test_dur_22_unknown_programs_rank_first_by_useful_value() -> None:
    """Covers DUR-22, DUR-23 for speculative programs, and SEL-23: an unmeasured program
    ranks first, with no division by zero."""
    known, unknown = spec(1, 0, 1), spec(1, 2, 3)
    cands = round_candidates([lane(1)], [known, unknown], {known: MS}, alpha=1.0,
                             waiting=0.0, mode=ADAPTIVE)
    assert cands[0].shape == unknown and cands[0].rate is None
    assert math.isfinite(cands[0].useful_value)


def test_spec_17_fixed_mode_skips_device_allocation() -> None:
    """Covers SPEC-17, SPEC-16: fixed mode runs host-allocated ragged programs only."""
    ragged, device = spec(2, 2, 3, 4), spec(2, 2, 3, 4, DEVICE)
    cands = round_candidates([lane(1), lane(2)], [ragged, device],
                             {ragged: MS, device: MS}, alpha=1.0, waiting=0.0, mode=FIXED)
    assert {c.shape for c in cands} == {ragged}


def test_queue_47_queued_advance_bound() -> None:
    """Covers QUEUE-47, QUEUE-48: a queued lane advances at most min(ceiling, P)."""
    assert queued_advance_bound(5, spec(1, 5, 6, 3)) == 3
    assert queued_advance_bound(2, spec(2, 5, 6, 8)) == 2
    # A lane never holds more rows than the program: its ceiling is already within P.
    narrow_p = spec(1, 3, 4, 2)
    assert lane_ceiling(narrow_p, 100) == 2 == queued_advance_bound(4, narrow_p)
    got = only(narrow_p, [lane(1, survival=(1.0, 1.0, 1.0))], ADAPTIVE)
    assert got.lanes[0].rows == got.lanes[0].ceiling == 2
    # A lane with 3 tokens left after a queued bound of 3 has a ceiling of 0 next.
    assert lane_ceiling(spec(1, 5, 6), 3 - queued_advance_bound(5, spec(1, 5, 6, 3))) == 0


def test_lrn_12_forecast_stops_at_frozen_ceiling() -> None:
    """Covers LRN-12, ACC-13, ACC-17, ACC-18: a completed round's forecast observation
    stops at min(D + 1, W) target rows; acceptance is a separate estimate."""
    assert forecast_observation((0.9, 0.8, 0.7, 0.6, 0.5), spec(1, 5, 3)) == (0.9, 0.8)
    assert forecast_observation((0.9, 0.8), spec(1, 2, 8)) == (0.9, 0.8)
    assert forecast_observation((), spec(1, 0, 1)) == ()
    state = AcceptanceState()
    src = ProposalSource.LEARNED
    observe_completed_round(state, src, spec(1, 5, 3), joint_prefix=(0.9, 0.8, 0.7, 0.6, 0.5),
                            offered=2, accepted=1, terminated=False)
    forecast = state.forecast(src)
    assert forecast.weight(2) == INITIAL_WEIGHT + 1 and forecast.weight(3) == INITIAL_WEIGHT
    assert forecast.mean(1) == pytest.approx((2 * 0.5 + 0.9) / 3)
    assert state.acceptance(src).mean(1) == pytest.approx((2 * 0.5 + 1.0) / 3)
    assert state.acceptance(src).mean(2) == pytest.approx((2 * 0.25 + 0.0) / 3)


def test_acc_5_lane_from_state_reads_its_source() -> None:
    """Covers ACC-5, ACC-25, ACC-26: a lane built for one source reads that source's
    means (for scoring) and optimistic bounds (for learning)."""
    state = AcceptanceState()
    state.preseed(ProposalSource.COPY, (0.8, 0.8), weight=128)
    built = {src: speculative_lane(handle=RequestHandle(1), epoch=1, state=state, source=src,
                                   depth_limit=2, token_value=1.0, delivery_value=0.0,
                                   age_value=0.0, age_slope=0.0, output_limit=9,
                                   context_limit=99) for src in ProposalSource}
    assert built[ProposalSource.COPY].survival == (0.8, 0.8)
    assert built[ProposalSource.LEARNED].survival == (0.5, 0.25)
    assert built[ProposalSource.LEARNED].optimistic[0] == 1.0  # weight 2: bound is 1
    assert built[ProposalSource.COPY].optimistic[0] == pytest.approx(
        0.8 + math.sqrt(math.log(20) / 256))
    assert built[ProposalSource.COPY].weights == (128.0, 128.0)


@pytest.mark.parametrize("seed", range(40))
def test_sel_27_best_lengths_with_pruning_equals_brute_force(seed: int) -> None:
    """Covers SEL-27 and SPEC-19 at the search level: on arbitrary (also non-concave)
    lane values, with duplicate lanes that the dominance pruning removes, the host
    search finds the exhaustive optimum over cohorts fitting B and P."""
    rng = np.random.default_rng(500 + seed)
    n, width = int(rng.integers(1, 8)), int(rng.integers(2, 5))
    batch = int(rng.integers(1, 4))
    total = int(rng.integers(1, batch * width + 1))
    options = np.round(rng.uniform(0, 5, (n, width + 1)), 0)
    ceil = rng.integers(1, width + 1, n)
    options[np.arange(width + 1)[None, :] > ceil[:, None]] = -np.inf
    if seed % 2:
        options[n // 2:] = options[0]  # duplicates: pruning must keep enough of them
        ceil[n // 2:] = ceil[0]
    options[:, 0] = 0.0
    got = best_lengths(options, batch, total)
    assert len(got) <= batch and sum(got.values()) <= total
    value = sum(options[i, r] for i, r in got.items())
    best = 0.0
    for rows in itertools.product(*[range(int(c) + 1) for c in ceil]):
        if sum(r > 0 for r in rows) <= batch and sum(rows) <= total:
            best = max(best, sum(options[i, r] for i, r in enumerate(rows) if r))
    assert value == pytest.approx(best)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_acc_1_3_candidate_tokens_equal_expected_output(alpha: float) -> None:
    """Covers ACC-1, ACC-2, ACC-3: every candidate's per-lane expected tokens equal
    ``speculation.expected_output`` at the lane's rows, alpha and request limit."""
    rng = np.random.default_rng(int(alpha * 10))
    lanes = random_lanes(rng, 12)
    shapes = [spec(b, w - 1, w, None, binding) for b in (2, 4, 8) for w in (1, 3, 6)
              for binding in (HOST, DEVICE)]
    cands = round_candidates(lanes, shapes, {s: 10 * MS for s in shapes}, alpha=alpha,
                             waiting=0.0, mode=ADAPTIVE, keep_dominated=True)
    by_handle = {ln.handle: ln for ln in lanes}
    checked = 0
    for c in cands:
        for ln in c.lanes:
            src = by_handle[ln.handle]
            assert ln.expected_tokens == pytest.approx(expected_output(
                src.survival, width=ln.rows, alpha=alpha, limit=src.request_limit))
            checked += 1
    assert checked > 50
