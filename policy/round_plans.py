"""Glue between speculative rounds and the Scheduler's plans.

This module owns the three steps the Scheduler needs around ``policy/rounds.py`` and
``policy/learning.py``, kept apart so that ``scheduler.py`` only calls them:

- ``speculative_lanes``: decoding requests -> ``SpeculativeLane`` inputs with the same
  projected prices, ages and scaling as ordinary selection (``policy/decision.py``:
  QUEUE-33, SEL-19, SEL-20), acceptance read for the configured proposal source (ACC-5);
- ``round_wins``: whether the best speculative candidate outranks the ordinary winner
  under selection's rule (unknown durations first by useful value, then value rate;
  DUR-22, DUR-23; ties: the shorter known time, then more lanes, DUR-24);
- ``round_plan``: a frozen ``ScheduledPlan`` for a candidate or probe (QUEUE-5). Complete
  speculative generation may occupy both frame slots (QUEUE-11) unless its cost is
  unknown or stale, or it is an exploration episode (QUEUE-13, QUEUE-36).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from policy.config import PolicyConfig
from policy.requests import RequestRecord
from policy.round_table import RoundCandidate, SpeculativeLane, speculative_lane
from policy.rounds import plan_lanes
from policy.service import ServiceHistory, delivery_price, output_token_price
from policy.speculation import AcceptanceState, PopulationPriors, ProposalSource
from policy.types import (
    RequestHandle,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.utility import NS_PER_MS, optimistic_rate, scaled

__all__ = ["Ranked", "ranked_plan", "round_plan", "round_wins", "speculative_lanes"]


def speculative_lanes(
    decoders: Sequence[RequestRecord],
    *,
    histories: Mapping[RequestHandle, ServiceHistory],
    states: Mapping[RequestHandle, AcceptanceState],
    priors: PopulationPriors,
    source: ProposalSource,
    depth_limit: int,
    context_room: Mapping[RequestHandle, int],
    config: PolicyConfig,
    exponent: int,
    age_slope: float,
    start_ns: int,
) -> list[SpeculativeLane]:
    """One lane per selectable decoder, valued exactly like ``decision.build_context``
    values ordinary decode lanes: scaled output and delivery prices from the projected
    history copies (``histories``; the stored history otherwise), age value
    ``age_slope * A_i`` at the planning start. ``context_room``: context positions left
    per request (absent: unbounded by context); output room is the record's, already net
    of queued advances (QUEUE-48). A request without an acceptance state reads a fresh
    one started from the population ``priors`` (ACC-18, ACC-19).
    """
    lanes = []
    for rec in decoders:
        h = histories.get(rec.handle, rec.history)
        state = states.get(rec.handle) or priors.fresh_state()
        lanes.append(speculative_lane(
            handle=rec.handle, epoch=rec.epoch, state=state, source=source,
            depth_limit=depth_limit,
            token_value=scaled(output_token_price(h, config), exponent),
            delivery_value=scaled(delivery_price(h, config), exponent),
            age_value=age_slope * (rec.output_age_ns(start_ns) / NS_PER_MS),
            age_slope=age_slope,
            output_limit=rec.output_room,
            context_limit=context_room.get(rec.handle, rec.output_room),
        ))
    return lanes


def _primary(known: bool, rate: float, useful: float) -> tuple[int, float]:
    return (0, useful) if not known else (1, rate)


class Ranked(Protocol):
    """What ``round_wins`` reads of a candidate (``RoundCandidate``, ``MixedRound``)."""

    @property
    def rate(self) -> float | None: ...
    @property
    def useful_value(self) -> float: ...
    @property
    def estimate_ns(self) -> int: ...
    @property
    def size(self) -> int: ...


def round_wins(candidate: Ranked | None, ordinary: ScheduledPlan | None) -> bool:
    """Whether ``candidate`` (a speculative round or a wider mixed candidate) outranks
    the current winner (selection's ranking rule)."""
    if candidate is None:
        return False
    if ordinary is None:
        return True
    known = candidate.rate is not None
    mine = _primary(known, candidate.rate or 0.0, candidate.useful_value)
    theirs = _primary(ordinary.duration_known, ordinary.scaled_score, ordinary.useful_value)
    # Unknown durations rank first (DUR-22), so "known" sorts low.
    if (-mine[0], mine[1]) != (-theirs[0], theirs[1]):
        return (-mine[0], mine[1]) > (-theirs[0], theirs[1])
    if known and candidate.estimate_ns != ordinary.estimated_duration_ns:
        return candidate.estimate_ns < ordinary.estimated_duration_ns
    return candidate.size > len(ordinary.lanes)


def round_plan(
    candidate: RoundCandidate,
    *,
    reason: SelectionReason,
    exponent: int,
    stale: bool,
    now_ns: int,
    start_ns: int,
) -> ScheduledPlan:
    """The frozen plan for ``candidate`` (for a probe, pass ``Probe.expected`` so the
    plan freezes mean-based service, ACC-25, with reason ACCEPTANCE_LEARNING)."""
    known = candidate.rate is not None
    return ranked_plan(
        candidate, ScheduledStep(shape=candidate.shape, lanes=plan_lanes(candidate)),
        reason=reason, exponent=exponent, stale=stale, now_ns=now_ns, start_ns=start_ns,
        requires_empty_window=(not known) or stale or reason is not SelectionReason.ORDINARY)


def ranked_plan(candidate: Ranked, step: ScheduledStep, *, reason: SelectionReason,
                exponent: int, stale: bool, now_ns: int, start_ns: int,
                requires_empty_window: bool) -> ScheduledPlan:
    """The frozen plan running ``step`` for a priced ``candidate``: its estimate, its
    value rate (the optimistic work score when the duration is unknown, OPEN-13) and
    useful value."""
    return ScheduledPlan(
        step=step,
        estimated_duration_ns=candidate.estimate_ns,
        scaled_score=candidate.rate if candidate.rate is not None
        else optimistic_rate(candidate.useful_value),
        scale_exponent=exponent,
        duration_known=candidate.rate is not None,
        stale=stale,
        reason=reason,
        requires_empty_window=requires_empty_window,
        planned_at_ns=now_ns,
        start_ns=start_ns,
        useful_value=candidate.useful_value,
    )
