"""Speculative round candidates and confidence forecasts (seed module ``rounds.rs``).

This module owns the speculative half of selection: for the decoding lanes of one
decision and every loaded speculative program ``(B, D, W, P, binding)`` it chooses a
cohort and per-lane target rows, prices the complete program and returns the
non-dominated candidates ranked like ordinary candidates. The Scheduler compares the
best of them with the ordinary winner on the same scaled F-SEL score.

Seed sections: *Speculative graph coverage*, *Completed confidence and acceptance*,
*Useful service and selection* (speculative parts), *Planning and the execution queue*
(the queued-lane advance bound).

- Lane value (SEL-19, ACC-1..3): a lane given ``L`` target rows is worth
  ``output price * E(L) + delivery price + c*sigma*(A + T)`` where
  ``E(L) = 1 + sum(s_i ** alpha, i < L)`` is ``speculation.expected_output``, bounded by
  the verified proposals, the output limit and the context (ACC-2, SEL-13). One visible
  burst is one delivery (SEL-4). Scores use ``utility.value_rate`` over the complete
  program's estimate ``T``, unused rows included (SPEC-31).
- Lane ceilings are ``min(D + 1, W, request limit)`` target rows (SPEC-25), never above
  ``P``; they may sum above ``P`` (SPEC-26).
- ``QueryLength`` (host) allocation fixes lengths before any proposal is drawn
  (SPEC-19..21). Fixed-width execution keeps complete prefixes, shortened only by
  request limits (SEL-26); when ``P`` constrains them the cohort is the highest-value
  one fitting both ``B`` and ``P`` (SEL-27). Adaptive execution lets each lane take any
  length ``1..ceiling`` and picks cohort and lengths together. Both are exact
  (``round_search.best_lengths``); when ``P`` cannot bind the best cohort is the top-``B``
  additive lane values (SEL-25). One candidate per program.
- ``SpeculativePrefixLimit`` (device) allocation: cohorts are prefixes of the lanes
  under three orderings, total lane value, pending-token delivery value and value per
  target row (SEL-28), each priced with the causal allocation the program would make on
  the lanes' confidence forecasts (SEL-29; ``round_search.frontier_allocation`` mirrors
  ``gpu/speculative/allocation.py``). At most ``3 * min(B, P)`` cohorts per program
  (SEL-30); the best is the program's candidate.
- Every loaded ``B`` and ``W`` competes, width one included (SPEC-6, SEL-24). Dominance
  drops a shape whose ``(B, W, P)`` are all at least another's, one strictly larger,
  only among candidates with the same cohort, lane rows, binding and actual proposal
  depth ``D`` (SEL-32, SEL-34).

Values are already scaled by the decision's shared exponent (SEL-20): callers pass
scaled prices, as ``policy/decision.py`` builds them. This module holds the modes, the
exact host search, dominance and ranking; the lanes, the lane table and the candidate
value are ``policy/round_table.py``, the top-``B`` and device cohorts
``policy/round_cohorts.py``. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from policy.descriptors import GraphKind, GraphShape, IdentityEnum, TargetBinding
from policy.round_cohorts import _device_candidates, _HostPick, _Pick
from policy.round_search import best_lengths, frontier_allocation
from policy.round_table import (
    LaneTable,
    Ordering,
    RoundCandidate,
    SpeculativeLane,
    lane_options,
    lane_width,
    priced_candidate,
)
from policy.types import Lane, LaneRole
from policy.utility import NS_PER_MS, value_rate

__all__ = [
    "RoundPrograms",
    "SpeculationMode",
    "best_round",
    "frontier_allocation",
    "plan_lanes",
    "price_rows",
    "rank_key",
    "ranked_rounds",
    "round_candidates",
]


class SpeculationMode(IdentityEnum):
    """How the loaded catalog is driven (modes selectable at ``flare run``)."""

    FIXED = "fixed"
    """Fixed-width: complete prefixes, host allocation only (SPEC-16, SPEC-17, LRN-10)."""
    ADAPTIVE = "adaptive"
    """Adaptive: host lengths or device allocation, widths compete (SPEC-6)."""


def _host_candidates(shape: GraphShape, table: LaneTable, estimate_ns: int,
                     waiting: float, mode: SpeculationMode) -> list[RoundCandidate]:
    best = _host_round(shape, table, estimate_ns, waiting, mode,
                       batch=shape.batch_capacity, packed=shape.packed_capacity,
                       width=lane_width(shape))
    return [best] if best is not None else []


def _host_round(shape: GraphShape, table: LaneTable, estimate_ns: int, waiting: float,
                mode: SpeculationMode, *, batch: int, packed: int, width: int
                ) -> RoundCandidate | None:
    """The best host-allocated cohort of at most ``batch`` lanes, ``width`` rows each and
    ``packed`` rows in all, priced over ``estimate_ns`` as ``shape`` (SEL-25, SEL-27).

    Fixed mode keeps complete prefixes. None when no lane has room."""
    if batch <= 0 or packed <= 0 or width <= 0:
        return None
    t_ms = estimate_ns / NS_PER_MS
    ceilings, at_ceiling = table.at_width(width)
    slope = table.slope
    full = at_ceiling + slope * t_ms
    top = np.argsort(-full, kind="stable")[:batch]
    top_ceilings = ceilings[top]
    if top_ceilings.min(initial=1) <= 0:
        keep = top_ceilings > 0
        top, top_ceilings = top[keep], top_ceilings[keep]
    if len(top) == 0:
        return None
    if int(top_ceilings.sum()) <= packed:
        # P does not constrain the best cohort: complete prefixes, top-B values (SEL-25).
        sums = (float(at_ceiling[top].sum()), float(slope[top].sum()))
        return priced_candidate(shape, table, top, top_ceilings, ceilings, estimate_ns, waiting,
                          Ordering.HOST, sums=sums)
    options = lane_options(table, ceilings, t_ms, complete=mode is SpeculationMode.FIXED)
    picked = best_lengths(options, batch, packed)
    chosen = sorted(picked.items(), key=lambda item: (-float(full[item[0]]), item[0]))
    index = np.array([i for i, _ in chosen], dtype=np.int64)
    rows = np.array([r for _, r in chosen], dtype=np.int64)
    if len(index) == 0:
        return None
    return priced_candidate(shape, table, index, rows, ceilings, estimate_ns, waiting,
                      Ordering.HOST)


def _host_picks(shapes: Sequence[GraphShape], estimates: Sequence[int], table: LaneTable,
                waiting: float, mode: SpeculationMode) -> list[_Pick]:
    """``_host_candidates`` for many host-allocated programs at once.

    Every program's top-``B`` cohort at complete ceilings comes from one stable sort of
    the lanes by value over the program's estimate and running sums of values, slopes
    and rows; where those rows fit ``P`` (always for rectangular programs) that cohort
    is the program's candidate (SEL-25), returned as a ``_HostPick``; where ``P`` binds,
    the exact per-program search decides (SEL-27) and returns ``RoundCandidate``s.

    A decision has at most ``max_batch`` lanes and a few dozen programs, so this runs on
    the table's cached Python lists and builds no arrays: numpy's per-call overhead on
    arrays of eight entries cost more than the arithmetic, and on the cpu backend every
    planning microsecond holds the GIL the model's worker thread needs
    (``docs/speculative-selection.md``, *Cost*). The sums run in ``np.cumsum``'s order
    and the sort is stable like ``np.argsort(kind="stable")``, so every figure is the
    former numpy pass's to the bit (``tests/policy/test_speculative_host_batch.py``).
    """
    n = len(table.lanes)
    if not shapes or n == 0:
        return []
    limits, slopes, base_rows = table.python_rows()
    widths = [lane_width(sh) for sh in shapes]
    out: list[_Pick] = []
    if min(limits) <= 0 or min(widths) <= 0:  # a lane without room: per-program path
        for shape, estimate in zip(shapes, estimates, strict=True):
            out.extend(_host_candidates(shape, table, estimate, waiting, mode))
        return out
    lanes = range(n)
    by_width: dict[int, tuple[list[int], list[float]]] = {}
    for shape, width, estimate in zip(shapes, widths, estimates, strict=True):
        got = by_width.get(width)
        if got is None:
            ceil = [limit if limit < width else width for limit in limits]
            got = by_width[width] = (ceil, [base_rows[i][c] for i, c in enumerate(ceil)])
        ceil, at = got
        estimate = int(estimate)
        t_ms = estimate / NS_PER_MS
        if n == 1:
            top = [0]
        else:
            keys = [-(a + s * t_ms) for a, s in zip(at, slopes, strict=True)]
            top = sorted(lanes, key=keys.__getitem__)[:min(shape.batch_capacity, n)]
        rows = [ceil[i] for i in top]
        rows_used = sum(rows)
        if rows_used > shape.packed_capacity:
            out.extend(_host_candidates(shape, table, estimate, waiting, mode))
            continue
        base = 0.0
        slope = 0.0
        for i in top:
            base += at[i]
            slope += slopes[i]
        out.append(_HostPick(
            shape=shape, base=base, slope=slope, estimate_ns=estimate,
            rate=value_rate(base, slope, t_ms, waiting) if estimate > 0 else None,
            cohort=top, rows=rows, rows_used=rows_used))
    return out


def _host_batch(shapes: Sequence[GraphShape], estimates: Sequence[int], table: LaneTable,
                waiting: float, mode: SpeculationMode) -> list[RoundCandidate]:
    """``_host_picks`` with every pick built into a ``RoundCandidate``."""
    return [p.candidate(table) if isinstance(p, _HostPick) else p
            for p in _host_picks(shapes, estimates, table, waiting, mode)]


def price_rows(candidate: RoundCandidate, lanes: Sequence[SpeculativeLane], estimate_ns: int,
               *, alpha: float, waiting: float, optimistic: bool = False) -> RoundCandidate:
    """Price ``candidate``'s cohort and rows again from ``lanes`` (for instance with the
    means after an optimistic search, ACC-25); lane order and rows are kept."""
    by_handle = {ln.handle: i for i, ln in enumerate(lanes)}
    max_rows = max((ln.rows for ln in candidate.lanes), default=1)
    table = LaneTable(lanes, max(max_rows, 1), alpha, optimistic=optimistic)
    ceilings = np.zeros(len(lanes), dtype=np.int64)
    chosen: list[tuple[int, int]] = []
    for ln in candidate.lanes:
        i = by_handle[ln.handle]
        ceilings[i] = ln.ceiling
        chosen.append((i, ln.rows))
    index = np.array([i for i, _ in chosen], dtype=np.int64)
    rows = np.array([r for _, r in chosen], dtype=np.int64)
    return priced_candidate(candidate.shape, table, index, rows, ceilings, estimate_ns, waiting,
                      candidate.ordering)


def rank_key(c: RoundCandidate) -> tuple[float, ...]:
    """Sort key, best first: unknown durations by useful value (DUR-22, DUR-23), then
    value rate, then shorter time, more lanes, fewer unused rows (DUR-24)."""
    known = c.rate is not None
    primary = c.rate if c.rate is not None else c.useful_value
    size = len(c.lane_index)
    return (float(known), -primary, float(c.estimate_ns), -float(size),
            float(c.shape.batch_capacity - size),
            float(c.shape.packed_capacity - c.rows_used))


def _dominance_filter(cands: list[_Pick], handles: Sequence[int] = ()) -> list[_Pick]:
    """Drop shapes whose (B, W, P) are all >= an alternative's with one larger, among
    candidates doing the same logical work at the same actual D (SEL-32, SEL-34).

    Candidates are first grouped by cheap parts of the logical key (D, binding, cohort
    size, rows); only groups with several members compare cohorts. Order is kept.
    ``handles``: the lane table's handles, for ``_HostPick`` entries."""
    coarse: dict[tuple[int, bool, int, int], list[int]] = {}
    for i, c in enumerate(cands):
        shape = c.shape
        size = len(c.cohort) if isinstance(c, _HostPick) else len(c.lane_index)
        key = (shape.proposal_depth, shape.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT,
               size, c.rows_used)
        coarse.setdefault(key, []).append(i)
    dropped: set[int] = set()
    for members in coarse.values():
        if len(members) < 2:
            continue
        groups: dict[tuple[tuple[int, int, int], ...], list[int]] = {}
        for i in members:
            c = cands[i]
            if isinstance(c, _HostPick):
                work = tuple(sorted((handles[j], r, r)
                                    for j, r in zip(c.cohort, c.rows, strict=True)))
            else:
                work = tuple(sorted(zip(c.handles.tolist(), c.rows.tolist(),
                                        c.ceilings.tolist(), strict=True)))
            groups.setdefault(work, []).append(i)
        for group in groups.values():
            if len(group) < 2:
                continue
            caps = [(cands[i].shape.batch_capacity, cands[i].shape.token_capacity,
                     cands[i].shape.packed_capacity) for i in group]
            for i, (b, w, p) in zip(group, caps, strict=True):
                for ob, ow, op in caps:
                    if b >= ob and w >= ow and p >= op and (b != ob or w != ow or p != op):
                        dropped.add(i)
                        break
    return [c for i, c in enumerate(cands) if i not in dropped] if dropped else cands


class RoundPrograms:
    """The speculative programs of one catalog with what every decision reads of them
    (widths, bindings), computed once per catalog rather than once per decision."""

    __slots__ = ("_host_for", "device", "host", "max_rows", "shapes", "widths")

    def __init__(self, shapes: Iterable[GraphShape]) -> None:
        self.shapes = [s for s in shapes if s.kind is GraphKind.SPECULATIVE]
        self.widths = [lane_width(s) for s in self.shapes]
        self.device = [i for i, s in enumerate(self.shapes)
                       if s.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT]
        device = set(self.device)
        self.host = [i for i in range(len(self.shapes)) if i not in device]
        self.max_rows = max(self.widths, default=0)
        self._host_for: dict[int, list[int]] = {}

    def host_for(self, lanes: int) -> list[int]:
        """``host`` less the rectangular programs the dominance filter would drop for a
        decision with ``lanes`` lanes, in catalog order (SEL-32).

        A rectangular host program (``P = B * W``) with ``B >= lanes`` takes every lane at
        complete ceilings; among those of one ``(D, W)`` the smallest ``B`` does the same
        work on smaller capacities, so the others can never survive the filter, and
        they dominate nothing it does not. Pricing them was most of a one-stream
        decision's cost. Refresh and probes (``keep_dominated``) still see every program.
        """
        got = self._host_for.get(lanes)
        if got is None:
            smallest: dict[tuple[int, int], tuple[int, int]] = {}
            for i in self.host:
                s = self.shapes[i]
                if s.packed_capacity == s.batch_capacity * s.token_capacity \
                        and s.batch_capacity >= lanes:
                    key = (s.proposal_depth, s.token_capacity)
                    if key not in smallest or s.batch_capacity < smallest[key][0]:
                        smallest[key] = (s.batch_capacity, i)
            kept = {i for _, i in smallest.values()}
            got = self._host_for[lanes] = [
                i for i in self.host
                if i in kept or not (
                    self.shapes[i].packed_capacity
                    == self.shapes[i].batch_capacity * self.shapes[i].token_capacity
                    and self.shapes[i].batch_capacity >= lanes)]
        return got


def round_candidates(
    lanes: Sequence[SpeculativeLane],
    shapes: Iterable[GraphShape],
    estimates_ns: Mapping[GraphShape, int],
    *,
    alpha: float,
    waiting: float,
    mode: SpeculationMode,
    optimistic: bool = False,
    keep_dominated: bool = False,
    every_cohort: bool = False,
) -> list[RoundCandidate]:
    """Every non-dominated speculative candidate of one decision, best first.

    ``shapes``: the loaded catalog (non-speculative shapes are ignored); every ``B`` and
    ``W`` competes (SPEC-6, SEL-24). ``estimates_ns``: each shape's complete-program
    estimate (missing or 0 = unknown). ``waiting``: the decision's scaled sum of ``c_i``
    (SEL-19). ``optimistic``: score with the ACC-26 bounds instead of the means
    (acceptance learning only, ACC-25). ``keep_dominated``: skip the SEL-34 filter
    (acceptance probes are separate from ordinary selection, like refresh, SEL-37).
    ``every_cohort``: return every cohort the device search priced, not only each
    program's best (probes look for one that offers a request a deeper prefix).
    Fixed mode skips device-allocated programs (SPEC-17).
    """
    programs = RoundPrograms(shapes)
    return ranked_rounds(lanes, programs, [int(estimates_ns.get(s, 0)) for s in programs.shapes],
                         alpha=alpha, waiting=waiting, mode=mode, optimistic=optimistic,
                         keep_dominated=keep_dominated, every_cohort=every_cohort)


def ranked_rounds(
    lanes: Sequence[SpeculativeLane],
    programs: RoundPrograms,
    estimates_ns: Sequence[int],
    *,
    alpha: float,
    waiting: float,
    mode: SpeculationMode,
    optimistic: bool = False,
    keep_dominated: bool = False,
    every_cohort: bool = False,
    limit: int | None = None,
    table: LaneTable | None = None,
) -> list[RoundCandidate]:
    """``round_candidates`` over a catalog's precomputed ``programs``; ``estimates_ns``
    aligned with ``programs.shapes`` (0 = unknown). The scheduler's per-decision path:
    no shape is hashed or re-measured. ``limit``: build only the best ``limit``
    candidates (ordinary selection reads the first). ``table``: the decision's
    ``lane_table`` of ``lanes`` (means, at least ``programs.max_rows`` rows), when the
    caller shares it with other candidates (``policy/mixed_rounds.py``)."""
    spec, est = programs.shapes, estimates_ns
    if table is None:
        live = [ln for ln in lanes if ln.request_limit > 0]
        if not spec or not live:
            return []
        table = LaneTable(live, programs.max_rows, alpha, optimistic=optimistic)
    elif not spec or not table.lanes:
        return []
    host = programs.host if keep_dominated else programs.host_for(len(table.lanes))
    out = _host_picks([spec[i] for i in host], [est[i] for i in host], table, waiting, mode)
    if mode is not SpeculationMode.FIXED:
        for i in programs.device:
            ceilings = table.at_width(programs.widths[i])[0]
            out.extend(_device_candidates(spec[i], table, ceilings, est[i], waiting,
                                          every=every_cohort))
    if not keep_dominated:
        out = _dominance_filter(out, table.python_handles())
    out.sort(key=_rank)
    return [c.candidate(table) if isinstance(c, _HostPick) else c for c in out[:limit]]


def _rank(c: _Pick) -> tuple[float, ...]:
    return c.rank() if isinstance(c, _HostPick) else rank_key(c)


def best_round(candidates: Sequence[RoundCandidate]) -> RoundCandidate | None:
    """The top-ranked candidate (see ``rank_key``), or None."""
    return min(candidates, key=rank_key) if candidates else None


def plan_lanes(candidate: RoundCandidate) -> tuple[Lane, ...]:
    """The plan's lanes in slot order (the device's tie-break order, SPEC-29).

    ``token_ceiling`` is the host length under ``QueryLength`` (SPEC-19) and the
    immutable ceiling under ``SpeculativePrefixLimit`` (SPEC-22); expected tokens and
    one expected delivery per lane are frozen for projection (QUEUE-41, SEL-4).
    """
    device = candidate.shape.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT
    return tuple(
        Lane(handle=ln.handle, epoch=ln.epoch, role=LaneRole.DECODE,
             token_ceiling=ln.ceiling if device else ln.rows,
             expected_tokens=ln.expected_tokens, expected_deliveries=1.0, value=ln.value)
        for ln in candidate.lanes)
