"""Speculative plans for the Scheduler (``policy/round_plans.py``)."""

from __future__ import annotations

import pytest

from policy.config import PolicyConfig
from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.requests import RequestRecord
from policy.round_plans import round_plan, round_wins, speculative_lanes
from policy.rounds import SpeculationMode, best_round, round_candidates
from policy.service import (
    Normalizers,
    delivery_price,
    new_history,
    output_token_price,
)
from policy.speculation import AcceptanceState, PopulationPriors, ProposalSource
from policy.types import (
    Lane,
    LaneRole,
    Phase,
    RequestHandle,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.utility import scale_exponent, scaled

MS = 1_000_000
LEARNED = ProposalSource.LEARNED


def spec(b: int, d: int, w: int, binding: TargetBinding = TargetBinding.QUERY_LENGTH
         ) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=d, packed_capacity=b * w, binding=binding)


def record(h: int, *, max_output: int = 50, committed: int = 0) -> RequestRecord:
    rec = RequestRecord(handle=RequestHandle(h), epoch=3, admitted_ns=0, prompt_len=8,
                        cached_prefix_len=0, max_output_tokens=max_output,
                        history=new_history(Normalizers(0.5, 0.05)))
    rec.phase = Phase.DECODE
    rec.prompt_cursor = 8
    rec.output_committed = committed
    rec.last_visible_ns = 10 * MS
    return rec


def ordinary_plan(rate: float, *, known: bool = True, useful: float = 1.0,
                  est: int = 10 * MS, lanes: int = 1) -> ScheduledPlan:
    shape = GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1,
                       packed_capacity=4)
    return ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=tuple(
            Lane(handle=RequestHandle(i), epoch=1, role=LaneRole.DECODE, token_ceiling=1)
            for i in range(lanes))),
        estimated_duration_ns=est if known else 0, scaled_score=rate, scale_exponent=0,
        duration_known=known, stale=False, reason=SelectionReason.ORDINARY,
        requires_empty_window=False, planned_at_ns=0, start_ns=0, useful_value=useful)


def test_speculative_lanes_use_decision_prices_and_limits() -> None:
    """Covers SEL-19, SEL-20, QUEUE-48, ACC-5: scaled prices from the projected history,
    age value at the planning start, output room net of queued work, source estimates."""
    config = PolicyConfig()
    a, b = record(1), record(2, max_output=10, committed=4)
    b.queued_outputs = 3
    projected = a.history.copy()
    projected.token_rate *= 4
    states = {a.handle: AcceptanceState()}
    states[a.handle].preseed(LEARNED, (0.9, 0.8), weight=64)
    e = scale_exponent([output_token_price(a.history, config)])
    lanes = speculative_lanes(
        [a, b], histories={a.handle: projected}, states=states, priors=PopulationPriors(),
        source=LEARNED, depth_limit=2, context_room={b.handle: 2}, config=config,
        exponent=e, age_slope=0.25, start_ns=30 * MS)
    assert lanes[0].token_value == scaled(output_token_price(projected, config), e)
    assert lanes[0].delivery_value == scaled(delivery_price(projected, config), e)
    assert lanes[0].age_value == pytest.approx(0.25 * 20.0)
    assert lanes[0].survival == (0.9, 0.8)
    assert lanes[1].survival == (0.5, 0.25)  # fresh: the population prior 0.5**d
    assert lanes[1].output_limit == 3 and lanes[1].request_limit == 2
    assert lanes[0].output_limit == 50


def test_round_wins_follows_selection_ranking() -> None:
    """Covers DUR-22, DUR-23, DUR-24 across ordinary and speculative candidates."""
    shape = spec(1, 1, 2)
    lanes = speculative_lanes(
        [record(1)], histories={}, states={}, priors=PopulationPriors(), source=LEARNED,
        depth_limit=1, context_room={}, config=PolicyConfig(), exponent=7, age_slope=0.0,
        start_ns=10 * MS)
    cand = best_round(round_candidates(lanes, [shape], {shape: 10 * MS}, alpha=1.0,
                                       waiting=0.0, mode=SpeculationMode.ADAPTIVE))
    assert cand is not None and cand.rate is not None
    assert round_wins(cand, None)
    assert round_wins(cand, ordinary_plan(cand.rate * 0.9))
    assert not round_wins(cand, ordinary_plan(cand.rate * 1.1))
    assert not round_wins(cand, ordinary_plan(0.0, known=False, useful=0.0))  # unknown first
    assert round_wins(cand, ordinary_plan(cand.rate, est=11 * MS))  # equal: shorter time
    assert not round_wins(cand, ordinary_plan(cand.rate, est=10 * MS, lanes=2))
    unknown = best_round(round_candidates(lanes, [shape], {}, alpha=1.0, waiting=0.0,
                                          mode=SpeculationMode.ADAPTIVE))
    assert unknown is not None and round_wins(unknown, ordinary_plan(1e9))


def test_round_plan_freezes_the_candidate() -> None:
    """Covers QUEUE-5, QUEUE-11, QUEUE-36, SPEC-19, SPEC-22: the plan carries the program,
    the lanes' rows (host) or ceilings (device), and may queue only as a known, fresh,
    ordinary generation program."""
    lanes = speculative_lanes(
        [record(1), record(2)], histories={}, states={}, priors=PopulationPriors(),
        source=LEARNED, depth_limit=3, context_room={}, config=PolicyConfig(), exponent=7,
        age_slope=0.0, start_ns=10 * MS)
    for binding in TargetBinding:
        shape = spec(2, 3, 4, binding)
        cand = best_round(round_candidates(lanes, [shape], {shape: 10 * MS}, alpha=1.0,
                                           waiting=0.0, mode=SpeculationMode.ADAPTIVE))
        assert cand is not None
        plan = round_plan(cand, reason=SelectionReason.ORDINARY, exponent=7, stale=False,
                          now_ns=5, start_ns=9)
        assert plan.shape == shape and plan.scaled_score == cand.rate
        assert not plan.requires_empty_window and plan.step.shape.is_generation
        assert [ln.token_ceiling for ln in plan.lanes] == [ln.ceiling for ln in cand.lanes]
        assert [ln.handle for ln in plan.lanes] == [ln.handle for ln in cand.lanes]
        assert all(ln.epoch == 3 for ln in plan.lanes)
        probe = round_plan(cand, reason=SelectionReason.ACCEPTANCE_LEARNING, exponent=7,
                           stale=False, now_ns=5, start_ns=9)
        assert probe.requires_empty_window
        assert round_plan(cand, reason=SelectionReason.ORDINARY, exponent=7, stale=True,
                          now_ns=5, start_ns=9).requires_empty_window
