"""Speculative lanes, the per-decision lane table and round candidates.

The values ``policy/rounds.py`` selects with: a decoding request as speculative selection
sees it (``SpeculativeLane``, ACC-1..3, ACC-25, ACC-26), its ceiling and queued-advance
bound (SPEC-25, QUEUE-47), the completed round's observation (ACC-13, LRN-12), the
decision's lane table (``lane_table``: each lane's value for every row count) and one
priced program with its cohort (``RoundCandidate``). Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from policy.descriptors import GraphShape, IdentityEnum
from policy.round_search import clean_forecast
from policy.speculation import AcceptanceState, ProposalSource
from policy.types import RequestHandle
from policy.utility import NS_PER_MS, FloatArray, IntArray, value_rate

__all__ = [
    "LaneTable",
    "Ordering",
    "RoundCandidate",
    "RoundLane",
    "SpeculativeLane",
    "forecast_observation",
    "lane_ceiling",
    "lane_options",
    "lane_table",
    "lane_width",
    "observe_completed_round",
    "priced_candidate",
    "queued_advance_bound",
    "speculative_lane",
]


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
    return max(min(lane_width(shape), request_limit), 0)


def lane_width(shape: GraphShape) -> int:
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


class LaneTable:
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


def lane_table(lanes: Sequence[SpeculativeLane], max_rows: int, alpha: float) -> LaneTable:
    """The decision's lane values (means, not optimistic bounds) for lanes with room,
    up to ``max_rows`` rows each, for ``ranked_rounds(table=...)`` and ``top_cohorts``."""
    return LaneTable([ln for ln in lanes if ln.request_limit > 0], max_rows, alpha,
                      optimistic=False)


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
    table: LaneTable
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


def priced_candidate(shape: GraphShape, table: LaneTable, index: IntArray, rows: IntArray,
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


def lane_options(table: LaneTable, ceilings: IntArray, t_ms: float, *, complete: bool
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
