"""Funded acceptance probes (seed module ``learning.rs``).

This module owns the choice of an acceptance-learning probe: a speculative round that
ordinary selection would not run, paid from the 0.01/0.99 acceptance ledger
(``policy/credit_ledgers.py``) to learn whether a request's drafts survive deeper than its
historical means say. Seed section: *Funded acceptance learning* (LRN-3..10, LRN-12),
with the optimistic estimate of *Completed confidence and acceptance* (ACC-26).

Rules, in the order ``find_probe`` applies them:

- fixed-width execution never probes (LRN-10); a pending timing refresh goes first
  (LRN-7); one episode at a time and only at full credit (LRN-8, LRN-15:
  ``CreditLedger.funded()`` is False while an episode is open); no probe beside an
  unknown-duration (discovery) ordinary winner, and probes use measured programs only
  (their gain is per physical time);
- candidates are the speculative rounds scored with the optimistic bound
  ``min(1, mean + sqrt(ln 20 / (2 w)))`` (ACC-26) over every loaded program, dominated
  padding included (a probe is outside ordinary selection, SEL-37);
- a probe offers at least one request at least one draft depth beyond what the ordinary
  choice offers it (LRN-3), and such a request must keep output beyond the round's
  ceiling, where the observation can pay off (LRN-5);
- its optimistic value rate must beat the ordinary choice's rate (LRN-4);
- ranking: optimistic score improvement per physical millisecond, highest first
  (LRN-6); exact ties prefer the least-informed added prefix (smallest aged weight over
  the added depths), then the shorter execution, then the smaller geometry
  ``(B, W, P, D)`` (LRN-9).

The Scheduler supplies what this module cannot see: whether a timing refresh is
pending this decision and the ordinary winner. Forecast observations of a completed
probe stop at the frozen ``min(D + 1, W)`` ceiling like any round's
(``rounds.forecast_observation``, LRN-12). The probe's plan freezes the *mean*-based
expected service (``Probe.expected``) for projection; the optimistic values only choose.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from policy.credit_ledgers import CreditLedger
from policy.descriptors import GraphKind, GraphShape
from policy.protocol import RoundLaneOutcome
from policy.round_table import RoundCandidate, SpeculativeLane
from policy.rounds import SpeculationMode, price_rows, round_candidates
from policy.types import RequestHandle, ScheduledPlan
from policy.utility import NS_PER_MS

__all__ = [
    "OrdinaryChoice",
    "Probe",
    "find_probe",
    "ordinary_from_plan",
    "ordinary_from_round",
    "probe_rank_key",
    "round_observations",
]


@dataclass(frozen=True, slots=True)
class OrdinaryChoice:
    """What ordinary selection chose: its scaled score and the draft depth it offers each
    request (absent = 0; an ordinary decode lane offers 0 drafts)."""

    rate: float | None
    """The ordinary winner's F-SEL rate; None when its duration is unknown."""
    offered_depth: Mapping[RequestHandle, int]


def ordinary_from_round(candidate: RoundCandidate) -> OrdinaryChoice:
    """A speculative ordinary winner: each lane offers ``rows - 1`` drafts."""
    return OrdinaryChoice(rate=candidate.rate,
                          offered_depth={ln.handle: max(ln.rows - 1, 0)
                                         for ln in candidate.lanes})


def ordinary_from_plan(plan: ScheduledPlan) -> OrdinaryChoice:
    """Any ordinary plan: a lane offers ``token_ceiling - 1`` drafts (0 for decode)."""
    return OrdinaryChoice(
        rate=plan.scaled_score if plan.duration_known else None,
        offered_depth={ln.handle: max(ln.token_ceiling - 1, 0) for ln in plan.lanes})


@dataclass(frozen=True, slots=True)
class Probe:
    """A chosen acceptance probe."""

    candidate: RoundCandidate
    """The round as scored with optimistic estimates (cohort, rows, optimistic rate)."""
    expected: RoundCandidate
    """The same cohort and rows priced with the means: the service to freeze (ACC-25)."""
    gain_per_ms: float
    """(optimistic rate - ordinary rate) / T in ms (LRN-6)."""
    probed: tuple[RequestHandle, ...]
    """Requests offered at least one depth beyond the ordinary choice (LRN-3)."""
    added_weight: float
    """Smallest aged weight over the added depths (LRN-9's first tie-break)."""


def _beyond(candidate: RoundCandidate, lanes: Mapping[RequestHandle, SpeculativeLane],
            ordinary: OrdinaryChoice) -> tuple[tuple[RequestHandle, ...], float]:
    """Requests the candidate probes (LRN-3 with LRN-5) and the least weight among the
    depths it adds (``inf`` when no weight is known)."""
    probed: list[RequestHandle] = []
    least = math.inf
    for ln in candidate.lanes:
        offered = ln.rows - 1
        before = ordinary.offered_depth.get(ln.handle, 0)
        lane = lanes[ln.handle]
        if offered < before + 1 or lane.output_limit <= ln.ceiling:
            continue
        probed.append(ln.handle)
        for depth in range(before + 1, offered + 1):
            if depth <= len(lane.weights):
                least = min(least, lane.weights[depth - 1])
    return tuple(probed), least


def probe_rank_key(gain_per_ms: float, added_weight: float, estimate_ns: int,
                   shape: GraphShape) -> tuple[float, float, int, tuple[int, int, int, int]]:
    """Sort key, best first: higher gain per ms (LRN-6), then the least-informed added
    prefix, the shorter execution, the smaller geometry ``(B, W, P, D)`` (LRN-9)."""
    geometry = (shape.batch_capacity, shape.token_capacity, shape.packed_capacity,
                shape.proposal_depth)
    return (-gain_per_ms, added_weight, estimate_ns, geometry)


def _mean_priced(candidate: RoundCandidate, lanes: Sequence[SpeculativeLane],
                 estimates_ns: Mapping[GraphShape, int], *, alpha: float,
                 waiting: float) -> RoundCandidate:
    """Re-price the probe's cohort and rows with the historical means (ACC-25)."""
    return price_rows(candidate, lanes, estimates_ns.get(candidate.shape, 0),
                      alpha=alpha, waiting=waiting)


def find_probe(
    *,
    lanes: Sequence[SpeculativeLane],
    shapes: Iterable[GraphShape],
    estimates_ns: Mapping[GraphShape, int],
    ordinary: OrdinaryChoice,
    ledger: CreditLedger,
    mode: SpeculationMode,
    alpha: float,
    waiting: float,
    refresh_pending: bool,
) -> Probe | None:
    """The acceptance probe to run instead of the ordinary choice, or None.

    ``refresh_pending``: a funded timing refresh has a candidate this decision; it takes
    precedence (LRN-7). ``ledger``: the acceptance-learning ledger; its ``funded()`` is
    full credit with no open episode (LRN-8, LRN-15).
    """
    if mode is SpeculationMode.FIXED or refresh_pending or not ledger.funded():
        return None
    if ordinary.rate is None:
        return None
    by_handle = {ln.handle: ln for ln in lanes}
    best: tuple[tuple[float, float, int, tuple[int, int, int, int]], Probe] | None = None
    for cand in round_candidates(lanes, shapes, estimates_ns, alpha=alpha, waiting=waiting,
                                 mode=mode, optimistic=True, keep_dominated=True,
                                 every_cohort=True):
        if cand.rate is None or cand.shape.kind is not GraphKind.SPECULATIVE:
            continue
        if cand.shape.proposal_depth == 0 or not cand.rate > ordinary.rate:
            continue  # LRN-4: cannot beat the ordinary choice even optimistically
        probed, least = _beyond(cand, by_handle, ordinary)
        if not probed:
            continue  # LRN-3, LRN-5
        t_ms = cand.estimate_ns / NS_PER_MS
        gain = (cand.rate - ordinary.rate) / t_ms
        key = probe_rank_key(gain, least, cand.estimate_ns, cand.shape)
        if best is None or key < best[0]:
            expected = _mean_priced(cand, lanes, estimates_ns, alpha=alpha, waiting=waiting)
            best = (key, Probe(candidate=cand, expected=expected, gain_per_ms=gain,
                               probed=probed, added_weight=least))
    return best[1] if best is not None else None


def round_observations(lanes: Iterable[RoundLaneOutcome], *, depth_beyond: bool
                       ) -> tuple[dict[RequestHandle, tuple[float, ...]],
                                  dict[RequestHandle, int]]:
    """What a completed round's lanes teach acceptance: each lane's survival values and
    offered depths (the drafts its source supplied and the target verified).

    With ``depth_beyond``, depth-``(D + 1)`` counterfactuals of learned rounds: a lane
    that verified all ``D`` of its drafts also reports whether the draft's next proposal
    would have held at the target's row ``D`` (``RoundLaneOutcome.beyond``). It becomes
    one more offered depth whose survival value is the last verified depth's times that
    probability (ACC-28): ``beyond`` after a fully accepted prefix, zero after a rejected
    one. Every such lane observes the extra depth, whatever it accepted, so the depth's
    mean stays an estimate of ``s_(D+1)`` (observing it only after full acceptance
    would estimate ``s_(D+1) / s_D``). A request whose deeper means fell can recover
    them one depth per round instead of only through probes (ACC-9 leaves them
    unobserved)."""
    survival: dict[RequestHandle, tuple[float, ...]] = {}
    offered: dict[RequestHandle, int] = {}
    for lane in lanes:
        survival[lane.handle] = lane.survival
        offered[lane.handle] = lane.evaluated
        if not depth_beyond or lane.beyond < 0.0 or lane.proposed < 1 \
                or lane.evaluated != lane.proposed:
            continue
        prefix = lane.survival or (
            (1.0,) * lane.accepted + (0.0,) * (lane.evaluated - lane.accepted))
        survival[lane.handle] = (*prefix, prefix[-1] * lane.beyond)
        offered[lane.handle] = lane.evaluated + 1
    return survival, offered
