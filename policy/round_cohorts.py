"""Cohorts of speculative programs other than the exact host search (``policy/rounds.py``).

- Top-``B`` cohorts at complete ceilings (``_HostPick``, ``top_cohorts``,
  ``cohort_round``): the candidate of every program whose ``P`` cannot bind (SEL-25),
  kept as Python values until it survives dominance filtering.
- ``SpeculativePrefixLimit`` (device) allocation (SEL-28..30): cohorts are prefixes of
  the lanes under three orderings, each priced with the causal allocation the program
  would make on the lanes' confidence forecasts (``round_search.prefix_cohort_values``).

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from policy.descriptors import GraphShape
from policy.round_search import prefix_cohort_values
from policy.round_table import (
    LaneTable,
    Ordering,
    RoundCandidate,
    SpeculativeLane,
    lane_options,
    lane_width,
    priced_candidate,
)
from policy.utility import NS_PER_MS, FloatArray, IntArray, value_rate

__all__ = [
    "HostCohort",
    "cohort_round",
    "device_cohort_values",
    "top_cohorts",
]


class HostCohort(NamedTuple):
    """A top-``batch`` cohort at complete ceilings (``top_cohorts``): table indices in
    slot order, rows, and the value at ``T = 0`` and age slope summed over it."""

    cohort: list[int]
    rows: list[int]
    base: float
    slope: float


def top_cohorts(table: LaneTable, specs: Sequence[tuple[int, int, int]]
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


def cohort_round(shape: GraphShape, table: LaneTable, cohort: HostCohort, estimate_ns: int,
                 waiting: float) -> RoundCandidate:
    """``cohort`` as a host-allocated ``RoundCandidate`` of ``shape``."""
    t_ms = estimate_ns / NS_PER_MS
    return _HostPick(
        shape=shape, base=cohort.base, slope=cohort.slope, estimate_ns=estimate_ns,
        rate=value_rate(cohort.base, cohort.slope, t_ms, waiting) if estimate_ns > 0
        else None, cohort=cohort.cohort, rows=cohort.rows,
        rows_used=sum(cohort.rows)).candidate(table)


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

    def candidate(self, table: LaneTable) -> RoundCandidate:
        rows = np.array(self.rows, dtype=np.int64)
        return RoundCandidate(
            shape=self.shape, base=self.base, slope=self.slope, estimate_ns=self.estimate_ns,
            rate=self.rate, ordering=Ordering.HOST, table=table,
            lane_index=np.array(self.cohort, dtype=np.int64), rows=rows, ceilings=rows,
            rows_used=self.rows_used)


_Pick = RoundCandidate | _HostPick


_ORDERINGS = (Ordering.TOTAL_VALUE, Ordering.DELIVERY_VALUE, Ordering.VALUE_PER_ROW)


def _device_search(shape: GraphShape, table: LaneTable, ceilings: IntArray,
                   t_ms: float) -> tuple[list[IntArray], FloatArray, IntArray]:
    """The bounded device search (SEL-28..30): for each ordering (total lane value,
    pending-token delivery value, value per target row) the lane order and the value and
    rows of every prefix cohort of at most ``min(B, P)`` lanes, priced with its own
    frontier allocation. Returns (orders, values ``[3, m]``, rows ``[3, m, m]``)."""
    live = np.nonzero(ceilings > 0)[0]
    limit = min(shape.batch_capacity, shape.packed_capacity, len(live))
    options = lane_options(table, ceilings, t_ms, complete=False)
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
    width = lane_width(shape)
    table = LaneTable(live, width, alpha, optimistic=False)
    ceilings = table.at_width(width)[0]
    return _device_search(shape, table, ceilings, estimate_ns / NS_PER_MS)[1]


def _device_candidates(shape: GraphShape, table: LaneTable, ceilings: IntArray,
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
        out.append(priced_candidate(shape, table, orders[k][: m + 1], rows[k, m, : m + 1],
                              ceilings, estimate_ns, waiting, _ORDERINGS[k]))
    return out
