"""The full candidate table: the executable specification of ordinary selection.

This is the selector as first written (seed module ``policy.rs``): every candidate is one
row of a numpy table with all ranking columns (value, slope, served requests, recency,
padding, prompt work, cohort sizes, dominance, DUR-20 exclusion), ranked by one
lexsort. ``selection.select`` makes the same decisions from vectorised candidate
families (``candidates.py``) without materialising the table; the tests compare the
two, bit for bit, on randomised catalogs and populations. Production never calls this
module. Rules: see ``selection.py``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from prerequisites_reference import best_prerequisite_reference

from policy.candidate_families import INT64_MAX, Candidate, dominated_by_smaller
from policy.selection import _build_plan, _restore_plan
from policy.types import ScheduledPlan, SelectionReason
from policy.utility import NS_PER_MS, BoolArray, FloatArray, IntArray, value_rates

if TYPE_CHECKING:
    from policy.decision_context import DecisionContext, LaneGroup


@dataclass(slots=True)
class _Table:
    """Column builders for the candidate table."""

    shape: list[IntArray]
    base: list[FloatArray]
    slope: list[FloatArray]
    served: list[IntArray]
    lru: list[IntArray]
    pad_rows: list[IntArray]
    pad_tokens: list[IntArray]
    prompt_pos: list[IntArray]
    prompt_tokens: list[IntArray]
    n_dec: list[IntArray]
    n_term: list[IntArray]
    dominated: list[BoolArray]
    excluded: list[BoolArray]

    @staticmethod
    def empty() -> _Table:
        return _Table([], [], [], [], [], [], [], [], [], [], [], [], [])

    def add(self, **cols: npt.NDArray[np.generic]) -> None:
        n = len(cols["shape"])
        for name in self.__slots__:
            col = cols.get(name)
            if col is None:
                if name in ("dominated", "excluded"):
                    col = np.zeros(n, dtype=np.bool_)
                elif name == "prompt_pos":
                    col = np.full(n, -1, dtype=np.int64)
                else:
                    col = np.zeros(n, dtype=np.int64)
            getattr(self, name).append(col)

    def cat(self, name: str) -> npt.NDArray[np.generic]:
        parts = getattr(self, name)
        return np.concatenate(parts) if parts else np.zeros(0)


def _cohort_candidates(table: _Table, ctx: DecisionContext, idx: IntArray,
                       group: LaneGroup, *, terminal: bool) -> None:
    """Decode or snapshot shapes: the first min(B, n) lanes of the sorted group."""
    if len(idx) == 0 or len(group) == 0:
        return
    cap = ctx.catalog.batch[idx]
    m = np.minimum(cap, len(group))
    dominated = np.zeros(len(idx), dtype=np.bool_)
    dominated[1:] = m[1:] == m[:-1]  # sorted by B: same cohort, larger capacities
    table.add(
        shape=idx, base=group.prefix[m], slope=m * group.slope, served=m,
        lru=group.lru_prefix_min[m], pad_rows=cap - m,
        n_dec=np.zeros_like(m) if terminal else m, n_term=m if terminal else np.zeros_like(m),
        dominated=dominated,
    )


def _prefill_candidates(table: _Table, ctx: DecisionContext, idx: IntArray,
                        scored: bool) -> None:
    p = ctx.prompts
    if len(idx) == 0 or not p.records or (scored and not p.scored.any()):
        return
    rows = np.nonzero(p.scored == scored)[0]
    if len(rows) == 0:
        return
    cap = ctx.catalog.capacities[idx, 1]
    remaining = p.logical_remaining[rows][:, None]
    tokens = np.minimum(cap[None, :], remaining)
    final = (tokens == remaining) & p.reaches_prompt_end[rows][:, None]
    value = tokens * p.token_price[rows][:, None] + final * p.finish_value[rows][:, None]
    dominated = np.zeros(tokens.shape, dtype=np.bool_)
    dominated[:, 1:] = tokens[:, 1:] == tokens[:, :-1]
    unknown = ctx.estimate_ns[idx] <= 0
    excluded = np.zeros(tokens.shape, dtype=np.bool_)
    # DUR-20: a smaller capacity already covers everything up to the next endpoint.
    excluded[:, 1:] = unknown[None, 1:] & (
        cap[None, :-1] >= p.endpoint_remaining[rows][:, None]
    )
    n_rows, n_shapes = tokens.shape
    table.add(
        shape=np.tile(idx, n_rows), base=value.ravel(), slope=np.zeros(tokens.size),
        served=np.ones(tokens.size, dtype=np.int64),
        lru=np.repeat(p.last_served[rows], n_shapes),
        pad_tokens=(cap[None, :] - tokens).ravel(),
        prompt_pos=np.repeat(rows, n_shapes), prompt_tokens=tokens.ravel(),
        dominated=dominated.ravel(), excluded=excluded.ravel(),
    )


def _mixed_candidates(table: _Table, ctx: DecisionContext) -> None:
    idx = ctx.catalog.mixed
    if len(idx) == 0:
        return
    dec, p = ctx.decoders, ctx.prompts
    cap_b = ctx.catalog.batch[idx]
    cap_c = ctx.catalog.capacities[idx, 2]
    cols: dict[str, list[npt.NDArray[np.generic]]] = {}

    def push(**kw: npt.NDArray[np.generic]) -> None:
        for k, v in kw.items():
            cols.setdefault(k, []).append(v)

    if len(dec):
        # Decode-only rows do the same work at every prompt capacity of a batch bucket,
        # so only each bucket's smallest prompt capacity can survive dominance.
        only = ctx.catalog.mixed_smallest_prompt
        ob, oc = ctx.catalog.batch[only], ctx.catalog.capacities[only, 2]
        m = np.minimum(ob, len(dec))
        push(shape=only, base=dec.prefix[m], slope=m * dec.slope, served=m,
             lru=dec.lru_prefix_min[m], pad_rows=ob - m, pad_tokens=oc,
             prompt_pos=np.full(len(only), -1), prompt_tokens=np.zeros(len(only)), n_dec=m)
    rows = np.nonzero(~p.scored)[0]
    if len(rows):
        remaining = p.logical_remaining[rows][:, None]
        tokens = np.minimum(cap_c[None, :], remaining)
        final = (tokens == remaining) & p.reaches_prompt_end[rows][:, None]
        value = tokens * p.token_price[rows][:, None] + final * p.finish_value[rows][:, None]
        # Best prompt row per shape; prompt rows are ordered least recently served
        # first, so argmax's first maximum is the DUR-24 tie-break.
        best = np.argmax(value, axis=0)
        col = np.arange(len(idx))
        best_tokens = tokens[best, col]
        m2 = np.minimum(cap_b - 1, len(dec))
        lru_m = np.where(m2 > 0, dec.lru_prefix_min[m2], INT64_MAX)
        push(shape=idx, base=value[best, col] + dec.prefix[m2], slope=m2 * dec.slope,
             served=m2 + 1, lru=np.minimum(p.last_served[rows][best], lru_m),
             pad_rows=cap_b - m2 - 1, pad_tokens=cap_c - best_tokens,
             prompt_pos=rows[best], prompt_tokens=best_tokens, n_dec=m2)
    if not cols:
        return
    merged = {k: np.concatenate(v) for k, v in cols.items()}
    keys = np.stack([merged["prompt_pos"], merged["prompt_tokens"], merged["n_dec"]], axis=1)
    shape_idx = merged["shape"].astype(np.int64, copy=False)
    caps = ctx.catalog.capacities[shape_idx]
    dominated = dominated_by_smaller(keys.astype(np.int64, copy=False), caps[:, 0], caps[:, 2])
    table.add(dominated=dominated, **merged)


def select_reference(ctx: DecisionContext) -> ScheduledPlan | None:
    """The winning plan of this decision, exactly as ``selection.select`` decides it."""
    table = _Table.empty()
    cat = ctx.catalog
    _cohort_candidates(table, ctx, cat.decode, ctx.decoders, terminal=False)
    _cohort_candidates(table, ctx, cat.snapshot, ctx.terminals, terminal=True)
    _prefill_candidates(table, ctx, cat.prefill, scored=False)
    _prefill_candidates(table, ctx, cat.scored_prefill, scored=True)
    _mixed_candidates(table, ctx)
    pair = best_prerequisite_reference(ctx)
    if not table.shape:
        return _restore_plan(ctx, pair) if pair is not None else None
    cols = {name: table.cat(name) for name in _Table.__slots__}
    shape = cols["shape"].astype(np.int64, copy=False)
    base = cols["base"].astype(np.float64, copy=False)
    est = ctx.estimate_ns[shape]
    known = est > 0
    slope = cols["slope"].astype(np.float64, copy=False)
    rates = value_rates(base, slope, est / NS_PER_MS, ctx.waiting)
    primary = np.where(known, rates, base)
    blocked = cols["excluded"].astype(np.bool_, copy=False)
    eligible = np.nonzero(~(cols["dominated"].astype(np.bool_, copy=False) | blocked))[0]
    if len(eligible) == 0:
        return _restore_plan(ctx, pair) if pair is not None else None

    def ranked(rows: IntArray, *first: npt.NDArray[np.generic]) -> IntArray:
        """``rows`` in ranking order: unknown first, value, then DUR-24 tie-breaks."""
        keys = (cols["pad_tokens"][rows], cols["pad_rows"][rows], cols["lru"][rows],
                -cols["served"][rows].astype(np.int64), np.where(known[rows], est[rows], 0), -primary[rows],
                known[rows].astype(np.int64), *first)
        result: IntArray = rows[np.lexsort(keys)]
        return result

    # Unknown durations win (DUR-22); only rows tied on the primary key need the sort.
    pool = eligible[~known[eligible]] if not known[eligible].all() else eligible
    top = pool[primary[pool] == primary[pool].max()]
    win = int(ranked(top)[0]) if len(top) > 1 else int(top[0])
    if pair is not None:
        # The pair competes on the same footing: unknown first, then value (PRE-2).
        pair_key = (0, pair.value) if pair.rate is None else (1, pair.rate)
        win_key = (1, float(primary[win])) if known[win] else (0, float(base[win]))
        if (-pair_key[0], pair_key[1]) > (-win_key[0], win_key[1]):
            return _restore_plan(ctx, pair)
    reason = SelectionReason.ORDINARY if known[win] else SelectionReason.DISCOVERY
    if ctx.refresh_funded and known[win]:
        stale = np.nonzero(ctx.stale[shape] & known & ~blocked & (shape != shape[win]))[0]
        if len(stale):
            # Least recently touched first (REF-8, OPEN-9), then ordinary ranking.
            win = int(ranked(stale, ctx.last_touched_ns[shape[stale]])[0])
            reason = SelectionReason.TIMING_REFRESH
    return _build_plan(ctx, _row(cols, win, rates, base, known, est), reason)


def _row(cols: dict[str, npt.NDArray[np.generic]], win: int, rates: FloatArray,
         base: FloatArray, known: BoolArray, est: IntArray) -> Candidate:
    """Table row ``win`` as the fast selector's ``Candidate`` (its table position is
    not needed once it has won)."""
    def col(name: str) -> int:
        return int(cols[name][win])

    return Candidate(-1, win, col("shape"), float(base[win]), float(rates[win]),
                     bool(known[win]), int(est[win]), col("served"), col("lru"),
                     col("pad_rows"), col("pad_tokens"), col("prompt_pos"),
                     col("prompt_tokens"), col("n_dec"), col("n_term"))
