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
scaled prices, as ``policy/decision.py`` builds them. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from policy.descriptors import GraphKind, GraphShape, IdentityEnum, TargetBinding
from policy.round_search import (
    best_lengths,
    clean_forecast,
    frontier_allocation,
    prefix_cohort_values,
)
from policy.speculation import AcceptanceState, ProposalSource
from policy.types import Lane, LaneRole, RequestHandle
from policy.utility import NS_PER_MS, FloatArray, value_rate

IntArray = npt.NDArray[np.int64]

__all__ = [
    "HostCohort",
    "LaneTable",
    "Ordering",
    "RoundCandidate",
    "RoundLane",
    "RoundPrograms",
    "SpeculationMode",
    "SpeculativeLane",
    "best_round",
    "cohort_round",
    "device_cohort_values",
    "forecast_observation",
    "frontier_allocation",
    "lane_ceiling",
    "lane_table",
    "observe_completed_round",
    "plan_lanes",
    "price_rows",
    "queued_advance_bound",
    "rank_key",
    "ranked_rounds",
    "round_candidates",
    "speculative_lane",
    "top_cohorts",
]


class SpeculationMode(IdentityEnum):
    """How the loaded catalog is driven (modes selectable at ``flare run``)."""

    FIXED = "fixed"
    """Fixed-width: complete prefixes, host allocation only (SPEC-16, SPEC-17, LRN-10)."""
    ADAPTIVE = "adaptive"
    """Adaptive: host lengths or device allocation, widths compete (SPEC-6)."""


class Ordering(IdentityEnum):
    """How a candidate's cohort was found."""

    HOST = "host"
    """Exact host choice (top-B, or the dynamic program when ``P`` binds)."""
    TOTAL_VALUE = "total_value"
    DELIVERY_VALUE = "delivery_value"
    VALUE_PER_ROW = "value_per_row"


class SpeculativeLane(NamedTuple):
    """One decoding request as speculative selection sees it (scaled values).

    ``token_value``/``delivery_value``: scaled output-token and delivery prices.
    ``age_value``: scaled ``c_i * sigma_i * A_i`` at the planning start; ``age_slope``:
    scaled ``c_i * sigma_i`` (the value of the program's own duration, SEL-19).
    ``output_limit``/``context_limit``: output tokens and context positions left after
    queued work (QUEUE-48). ``survival``: ``s_1..s_n`` means for the program's source
    (ACC-25). ``forecast``: joint-prefix-probability forecast means, the device
    allocation's input (ACC-18); empty means "use ``survival``". ``optimistic`` and
    ``weights``: the ACC-26 bound and aged weights per depth, for acceptance learning.
    """

    handle: RequestHandle
    epoch: int
    token_value: float
    delivery_value: float
    age_value: float
    age_slope: float
    output_limit: int
    context_limit: int
    survival: tuple[float, ...]
    forecast: tuple[float, ...] = ()
    optimistic: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()

    @property
    def request_limit(self) -> int:
        """Output tokens this round may commit at most (ACC-2, SPEC-25)."""
        return max(min(self.output_limit, self.context_limit), 0)


def speculative_lane(
    *,
    handle: RequestHandle,
    epoch: int,
    state: AcceptanceState,
    source: ProposalSource,
    depth_limit: int,
    token_value: float,
    delivery_value: float,
    age_value: float,
    age_slope: float,
    output_limit: int,
    context_limit: int,
) -> SpeculativeLane:
    """Build a lane from a request's acceptance state for the program's ``source``
    (ACC-5): means for ordinary scoring, forecast means for device allocation, and the
    optimistic bounds and weights funded learning reads (ACC-25, ACC-26)."""
    estimate = state.acceptance(source)
    return SpeculativeLane(
        handle=handle, epoch=epoch, token_value=token_value,
        delivery_value=delivery_value, age_value=age_value, age_slope=age_slope,
        output_limit=output_limit, context_limit=context_limit,
        survival=state.survival(source, depth_limit),
        forecast=state.forecast_means(source, depth_limit),
        optimistic=state.optimistic_survival(source, depth_limit),
        weights=estimate.weights(depth_limit),
    )


def lane_ceiling(shape: GraphShape, request_limit: int) -> int:
    """``min(D + 1, W, request limit)`` target rows (SPEC-25), never above ``P`` (no lane
    can hold more rows than the program, QUEUE-47); 0 when nothing is left."""
    return max(min(_width(shape), request_limit), 0)


def _width(shape: GraphShape) -> int:
    """The most rows one lane of ``shape`` can verify: ``min(D + 1, W, P)``."""
    return min(shape.proposal_depth + 1, shape.token_capacity, shape.packed_capacity)


def queued_advance_bound(ceiling: int, shape: GraphShape) -> int:
    """The most a queued speculative lane can advance: ``min(ceiling, P)`` (QUEUE-47).

    Output limits and continuation positions of later decisions subtract it (QUEUE-48).
    """
    return max(min(ceiling, shape.packed_capacity), 0)


def forecast_observation(joint_prefix: Sequence[float], shape: GraphShape) -> tuple[float, ...]:
    """The completed round's joint prefix probabilities a forecast may observe: draft
    positions up to the frozen ``min(D + 1, W)`` ceiling, i.e. ``min(D, W - 1)`` of them
    (LRN-12). Request limits do not shorten it (OPEN-28, decided here: the confidence
    describes the drafts, which the program produced whatever the output limit;
    termination already censors acceptance, ACC-8)."""
    depth = min(shape.proposal_depth, shape.token_capacity - 1)
    return tuple(float(v) for v in joint_prefix[:max(depth, 0)])


def observe_completed_round(
    state: AcceptanceState,
    source: ProposalSource,
    shape: GraphShape,
    *,
    joint_prefix: Sequence[float] | None,
    offered: int,
    accepted: int,
    terminated: bool,
    survival: Sequence[float] | None = None,
) -> None:
    """Fold one *completed* round of one lane into its request's estimates (ACC-13).

    ``joint_prefix``: rank zero's sidecar row ``[1, slot, :]`` (ACC-14), or None when the
    program produced no confidence; it updates the forecast up to the LRN-12 ceiling
    (ACC-17..20). ``offered``/``accepted``/``terminated``/``survival`` update verified
    acceptance (ACC-6..9, ACC-28). Cancelled or in-flight rounds must not be passed.
    """
    if joint_prefix is not None:
        state.observe_forecast(source, forecast_observation(joint_prefix, shape))
    state.observe_round(source, offered=offered, accepted=accepted,
                        terminated=terminated, survival=survival)


class RoundLane(NamedTuple):
    """One lane of a speculative candidate.

    ``rows``: target rows the host fixed (``QueryLength``) or the forecast allocation
    it was priced with (``SpeculativePrefixLimit``); ``ceiling``: the immutable ceiling.
    """

    handle: RequestHandle
    epoch: int
    rows: int
    ceiling: int
    expected_tokens: float
    value: float


class _LaneTable:
    """Per-decision lane values: ``base[i, L]`` for ``L`` target rows (0 for ``L = 0``)."""

    def __init__(self, lanes: Sequence[SpeculativeLane], max_rows: int, alpha: float,
                 *, optimistic: bool) -> None:
        self.lanes = tuple(lanes)
        n = len(self.lanes)
        self.limit = np.array([ln.request_limit for ln in self.lanes], dtype=np.int64)
        self.slope = np.array([ln.age_slope for ln in self.lanes], dtype=np.float64)
        self.handles = np.array([ln.handle for ln in self.lanes], dtype=np.int64)
        self.index = np.arange(n, dtype=np.int64)
        if not (np.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be finite and positive, got {alpha!r}")
        depth = max(max_rows - 1, 0)
        survival = np.zeros((n, depth), dtype=np.float64)
        self.forecast = np.zeros((n, depth), dtype=np.float64)
        for i, ln in enumerate(self.lanes):
            s = (ln.optimistic if optimistic and ln.optimistic else ln.survival)[:depth]
            survival[i, :len(s)] = s
            fc = (ln.forecast or ln.survival)[:depth]
            self.forecast[i, :len(fc)] = fc
        # speculation.expected_output for every width at once: 1 + sum(s_i ** alpha, i < L),
        # at most the request limit (ACC-1..3); column 0 (no rows) is worth nothing.
        self.tokens = np.zeros((n, max_rows + 1), dtype=np.float64)
        if n and max_rows:
            gained = np.cumsum(np.power(survival, alpha), axis=1)
            widths = np.concatenate([np.zeros((n, 1)), gained], axis=1) + 1.0
            self.tokens[:, 1:] = np.minimum(widths, np.maximum(self.limit, 0)[:, None])
        entry = np.array([ln.delivery_value + ln.age_value for ln in self.lanes],
                         dtype=np.float64)
        value = np.array([ln.token_value for ln in self.lanes], dtype=np.float64)
        self.base = value[:, None] * self.tokens + entry[:, None]
        self.base[:, 0] = 0.0
        self._by_width: dict[int, tuple[IntArray, FloatArray]] = {}
        self._clean_forecast: FloatArray | None = None
        self._python_rows: tuple[list[int], list[float], list[list[float]]] | None = None
        self._python_handles: list[int] | None = None

    def python_handles(self) -> list[int]:
        """``handles`` as a Python list, once per decision."""
        if self._python_handles is None:
            self._python_handles = self.handles.tolist()
        return self._python_handles

    def python_rows(self) -> tuple[list[int], list[float], list[list[float]]]:
        """``limit``, ``slope`` and ``base`` as Python lists, once per decision (the
        host search's small-array path, ``_host_batch``)."""
        if self._python_rows is None:
            self._python_rows = (self.limit.tolist(), self.slope.tolist(),
                                 self.base.tolist())
        return self._python_rows

    @property
    def clean_forecast(self) -> FloatArray:
        """``forecast`` as the device frontier reads it (``round_search.clean_forecast``),
        once per decision."""
        if self._clean_forecast is None:
            self._clean_forecast = clean_forecast(self.forecast)
        return self._clean_forecast

    def at_width(self, width: int) -> tuple[IntArray, FloatArray]:
        """Each lane's ceiling ``min(request limit, width)`` and its value at that many
        rows (time-independent part), computed once per width and decision."""
        got = self._by_width.get(width)
        if got is None:
            ceilings = np.minimum(self.limit, width)
            got = self._by_width[width] = (ceilings, self.base[self.index, ceilings])
        return got


LaneTable = _LaneTable
"""The decision's lane table, as other policy modules name it (``lane_table`` builds it)."""


@dataclass(frozen=True, slots=True, eq=False)
class RoundCandidate:
    """One speculative program with its cohort, priced as a complete program.

    The cohort is kept as index arrays into the decision's lane table (built per program
    on every decision); ``lanes`` materialises it, in slot order, when a caller needs it.
    """

    shape: GraphShape
    base: float
    """Scaled value at ``T = 0`` (token and delivery service plus age so far)."""
    slope: float
    """Sum of the lanes' ``c_i * sigma_i`` (scaled)."""
    estimate_ns: int
    """The complete program's estimate (0 = unknown, SPEC-31)."""
    rate: float | None
    """F-SEL value rate; None for an unknown duration (ranked by useful value)."""
    ordering: Ordering
    table: _LaneTable
    lane_index: IntArray
    """Index into the table's lanes of each cohort member, in slot order."""
    rows: IntArray
    ceilings: IntArray
    """Each member's immutable ceiling, slot order."""
    rows_used: int

    @property
    def source_lanes(self) -> tuple[SpeculativeLane, ...]:
        return self.table.lanes

    @property
    def handles(self) -> IntArray:
        handles: IntArray = self.table.handles[self.lane_index]
        return handles

    @property
    def expected_tokens(self) -> FloatArray:
        tokens: FloatArray = self.table.tokens[self.lane_index, self.rows]
        return tokens

    @property
    def values(self) -> FloatArray:
        """Each member's scaled value over the program's duration."""
        t_ms = self.estimate_ns / NS_PER_MS
        values: FloatArray = (self.table.base[self.lane_index, self.rows]
                              + self.table.slope[self.lane_index] * t_ms)
        return values

    @property
    def lanes(self) -> tuple[RoundLane, ...]:
        """The cohort, in slot order."""
        source = self.table.lanes
        return tuple(
            RoundLane(handle=source[i].handle, epoch=source[i].epoch,
                      rows=int(r), ceiling=int(c), expected_tokens=float(e), value=float(v))
            for i, r, c, e, v in zip(self.lane_index.tolist(), self.rows, self.ceilings,
                                     self.expected_tokens, self.values, strict=True))

    @property
    def useful_value(self) -> float:
        """Scaled useful value including the age earned over the program (DUR-23)."""
        return self.base + self.slope * self.estimate_ns / NS_PER_MS

    @property
    def size(self) -> int:
        return len(self.lane_index)

    def logical_key(self) -> tuple[object, ...]:
        """What dominance compares: cohort, rows, ceilings, binding and actual D (SEL-34)."""
        work = sorted(zip(self.handles.tolist(), self.rows.tolist(), self.ceilings.tolist(),
                          strict=True))
        return (self.shape.proposal_depth, self.shape.binding, tuple(work))


def _candidate(shape: GraphShape, table: _LaneTable, index: IntArray, rows: IntArray,
               ceilings: IntArray, estimate_ns: int, waiting: float,
               ordering: Ordering, *, sums: tuple[float, float] | None = None
               ) -> RoundCandidate:
    """Price cohort ``index`` (slot order) with ``rows`` each over the complete program.
    ``ceilings``: every table lane's ceiling for ``shape``; ``sums``: the cohort's value
    at ``T = 0`` and age slope when the caller already has them."""
    if sums is None:
        base = float(table.base[index, rows].sum())
        slope = float(table.slope[index].sum())
    else:
        base, slope = sums
    rate = value_rate(base, slope, estimate_ns / NS_PER_MS, waiting) \
        if estimate_ns > 0 else None
    return RoundCandidate(shape=shape, base=base, slope=slope, estimate_ns=estimate_ns,
                          rate=rate, ordering=ordering, table=table, lane_index=index,
                          rows=rows, ceilings=ceilings[index], rows_used=int(rows.sum()))


def _options(table: _LaneTable, ceilings: IntArray, t_ms: float, *, complete: bool
             ) -> FloatArray:
    """``options[i, L]``: lane ``i``'s value with ``L`` rows over ``t_ms`` (``-inf`` where
    not allowed: past the ceiling, or below it when prefixes must be complete)."""
    width = table.base.shape[1]
    values = table.base + table.slope[:, None] * t_ms
    rows = np.arange(width)[None, :]
    allowed = (rows <= ceilings[:, None]) & (rows >= 1)
    if complete:
        allowed &= rows == ceilings[:, None]
    options: FloatArray = np.where(allowed, values, -np.inf)
    options[:, 0] = 0.0
    return options


def _host_candidates(shape: GraphShape, table: _LaneTable, estimate_ns: int,
                     waiting: float, mode: SpeculationMode) -> list[RoundCandidate]:
    best = _host_round(shape, table, estimate_ns, waiting, mode,
                       batch=shape.batch_capacity, packed=shape.packed_capacity,
                       width=_width(shape))
    return [best] if best is not None else []


def _host_round(shape: GraphShape, table: _LaneTable, estimate_ns: int, waiting: float,
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
        return _candidate(shape, table, top, top_ceilings, ceilings, estimate_ns, waiting,
                          Ordering.HOST, sums=sums)
    options = _options(table, ceilings, t_ms, complete=mode is SpeculationMode.FIXED)
    picked = best_lengths(options, batch, packed)
    chosen = sorted(picked.items(), key=lambda item: (-float(full[item[0]]), item[0]))
    index = np.array([i for i, _ in chosen], dtype=np.int64)
    rows = np.array([r for _, r in chosen], dtype=np.int64)
    if len(index) == 0:
        return None
    return _candidate(shape, table, index, rows, ceilings, estimate_ns, waiting,
                      Ordering.HOST)


class HostCohort(NamedTuple):
    """A top-``batch`` cohort at complete ceilings (``top_cohorts``): table indices in
    slot order, rows, and the value at ``T = 0`` and age slope summed over it."""

    cohort: list[int]
    rows: list[int]
    base: float
    slope: float


def top_cohorts(table: _LaneTable, specs: Sequence[tuple[int, int, int]]
                ) -> list[HostCohort | None]:
    """For each ``(batch, width, estimate_ns)``: the best ``batch`` lanes of ``table``
    at complete ceilings ``min(request limit, width)``, by value over the estimate (the
    ``_host_picks`` pass, on the table's Python lists: same order, same sums). For
    programs whose ``P`` cannot bind (a wider mixed program, ``policy/mixed_rounds``);
    None where ``batch`` is 0."""
    limits, slopes, base_rows = table.python_rows()
    n = len(limits)
    lanes = range(n)
    by_width: dict[int, tuple[list[int], list[float]]] = {}
    out: list[HostCohort | None] = []
    for batch, width, estimate in specs:
        if batch <= 0 or n == 0:
            out.append(None)
            continue
        got = by_width.get(width)
        if got is None:
            ceil = [limit if limit < width else width for limit in limits]
            got = by_width[width] = (ceil, [base_rows[i][c] for i, c in enumerate(ceil)])
        ceil, at = got
        t_ms = estimate / NS_PER_MS
        if n == 1:
            top = [0]
        else:
            keys = [-(a + s * t_ms) for a, s in zip(at, slopes, strict=True)]
            top = sorted(lanes, key=keys.__getitem__)[:batch]
        base = 0.0
        slope = 0.0
        for i in top:
            base += at[i]
            slope += slopes[i]
        out.append(HostCohort(cohort=top, rows=[ceil[i] for i in top], base=base,
                              slope=slope))
    return out


def cohort_round(shape: GraphShape, table: _LaneTable, cohort: HostCohort, estimate_ns: int,
                 waiting: float) -> RoundCandidate:
    """``cohort`` as a host-allocated ``RoundCandidate`` of ``shape``."""
    t_ms = estimate_ns / NS_PER_MS
    return _HostPick(
        shape=shape, base=cohort.base, slope=cohort.slope, estimate_ns=estimate_ns,
        rate=value_rate(cohort.base, cohort.slope, t_ms, waiting) if estimate_ns > 0
        else None, cohort=cohort.cohort, rows=cohort.rows,
        rows_used=sum(cohort.rows)).candidate(table)


def lane_table(lanes: Sequence[SpeculativeLane], max_rows: int, alpha: float) -> _LaneTable:
    """The decision's lane values (means, not optimistic bounds) for lanes with room,
    up to ``max_rows`` rows each, for ``ranked_rounds(table=...)`` and ``top_cohorts``."""
    return _LaneTable([ln for ln in lanes if ln.request_limit > 0], max_rows, alpha,
                      optimistic=False)


class _HostPick(NamedTuple):
    """A host program's top-``B`` cohort at complete ceilings, kept as Python values
    until it survives dominance filtering (``_host_picks``); ``candidate`` builds the
    ``RoundCandidate``."""

    shape: GraphShape
    base: float
    slope: float
    estimate_ns: int
    rate: float | None
    cohort: list[int]
    rows: list[int]
    rows_used: int

    def rank(self) -> tuple[float, ...]:
        """``rank_key`` of the candidate this pick becomes."""
        known = self.rate is not None
        primary = self.rate if self.rate is not None \
            else self.base + self.slope * self.estimate_ns / NS_PER_MS
        size = len(self.cohort)
        return (float(known), -primary, float(self.estimate_ns), -float(size),
                float(self.shape.batch_capacity - size),
                float(self.shape.packed_capacity - self.rows_used))

    def candidate(self, table: _LaneTable) -> RoundCandidate:
        rows = np.array(self.rows, dtype=np.int64)
        return RoundCandidate(
            shape=self.shape, base=self.base, slope=self.slope, estimate_ns=self.estimate_ns,
            rate=self.rate, ordering=Ordering.HOST, table=table,
            lane_index=np.array(self.cohort, dtype=np.int64), rows=rows, ceilings=rows,
            rows_used=self.rows_used)


_Pick = RoundCandidate | _HostPick


def _host_picks(shapes: Sequence[GraphShape], estimates: Sequence[int], table: _LaneTable,
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
    widths = [_width(sh) for sh in shapes]
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


def _host_batch(shapes: Sequence[GraphShape], estimates: Sequence[int], table: _LaneTable,
                waiting: float, mode: SpeculationMode) -> list[RoundCandidate]:
    """``_host_picks`` with every pick built into a ``RoundCandidate``."""
    return [p.candidate(table) if isinstance(p, _HostPick) else p
            for p in _host_picks(shapes, estimates, table, waiting, mode)]


_ORDERINGS = (Ordering.TOTAL_VALUE, Ordering.DELIVERY_VALUE, Ordering.VALUE_PER_ROW)


def _device_search(shape: GraphShape, table: _LaneTable, ceilings: IntArray,
                   t_ms: float) -> tuple[list[IntArray], FloatArray, IntArray]:
    """The bounded device search (SEL-28..30): for each ordering (total lane value,
    pending-token delivery value, value per target row) the lane order and the value and
    rows of every prefix cohort of at most ``min(B, P)`` lanes, priced with its own
    frontier allocation. Returns (orders, values ``[3, m]``, rows ``[3, m, m]``)."""
    live = np.nonzero(ceilings > 0)[0]
    limit = min(shape.batch_capacity, shape.packed_capacity, len(live))
    options = _options(table, ceilings, t_ms, complete=False)
    full = options[live, ceilings[live]]
    keys = (full, options[live, 1], full / ceilings[live])
    orders: list[IntArray] = []
    values = np.zeros((len(keys), limit), dtype=np.float64)
    rows = np.zeros((len(keys), limit, limit), dtype=np.int64)
    forecast = table.clean_forecast[:, : shape.proposal_depth]
    for k, key in enumerate(keys):
        order = live[np.argsort(-key, kind="stable")][:limit].astype(np.int64)
        same = next((j for j in range(k) if np.array_equal(orders[j], order)), None)
        orders.append(order)
        if same is not None:  # homogeneous lanes often give one order thrice
            values[k], rows[k] = values[same], rows[same]
        elif limit:
            values[k], rows[k] = prefix_cohort_values(options, forecast, ceilings, order,
                                                      shape.packed_capacity, cleaned=True)
    return orders, values, rows


def device_cohort_values(lanes: Sequence[SpeculativeLane], shape: GraphShape, *,
                         estimate_ns: int, alpha: float) -> FloatArray:
    """Scaled value (at the program's duration) of every cohort the device search prices
    for ``shape``: ``[3, min(B, P, lanes)]``, one row per ordering (SEL-28, SEL-30)."""
    live = [ln for ln in lanes if ln.request_limit > 0]
    width = _width(shape)
    table = _LaneTable(live, width, alpha, optimistic=False)
    ceilings = table.at_width(width)[0]
    return _device_search(shape, table, ceilings, estimate_ns / NS_PER_MS)[1]


def _device_candidates(shape: GraphShape, table: _LaneTable, ceilings: IntArray,
                       estimate_ns: int, waiting: float, *, every: bool
                       ) -> list[RoundCandidate]:
    orders, values, rows = _device_search(shape, table, ceilings, estimate_ns / NS_PER_MS)
    if values.shape[1] == 0:
        return []
    if every:
        picks = [(k, m) for k in range(values.shape[0]) for m in range(values.shape[1])]
    else:
        k, m = divmod(int(np.argmax(values)), values.shape[1])
        picks = [(k, m)]
    seen: set[tuple[int, ...]] = set()
    out: list[RoundCandidate] = []
    for k, m in picks:
        cohort = tuple(int(i) for i in orders[k][: m + 1])
        if cohort in seen:
            continue
        seen.add(cohort)
        out.append(_candidate(shape, table, orders[k][: m + 1], rows[k, m, : m + 1],
                              ceilings, estimate_ns, waiting, _ORDERINGS[k]))
    return out


def price_rows(candidate: RoundCandidate, lanes: Sequence[SpeculativeLane], estimate_ns: int,
               *, alpha: float, waiting: float, optimistic: bool = False) -> RoundCandidate:
    """Price ``candidate``'s cohort and rows again from ``lanes`` (for instance with the
    means after an optimistic search, ACC-25); lane order and rows are kept."""
    by_handle = {ln.handle: i for i, ln in enumerate(lanes)}
    max_rows = max((ln.rows for ln in candidate.lanes), default=1)
    table = _LaneTable(lanes, max(max_rows, 1), alpha, optimistic=optimistic)
    ceilings = np.zeros(len(lanes), dtype=np.int64)
    chosen: list[tuple[int, int]] = []
    for ln in candidate.lanes:
        i = by_handle[ln.handle]
        ceilings[i] = ln.ceiling
        chosen.append((i, ln.rows))
    index = np.array([i for i, _ in chosen], dtype=np.int64)
    rows = np.array([r for _, r in chosen], dtype=np.int64)
    return _candidate(candidate.shape, table, index, rows, ceilings, estimate_ns, waiting,
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
        self.widths = [_width(s) for s in self.shapes]
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
    table: _LaneTable | None = None,
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
        table = _LaneTable(live, programs.max_rows, alpha, optimistic=optimistic)
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
