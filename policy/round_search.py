"""Array searches behind speculative round selection (used by ``policy/rounds.py``).

Seed section: *Useful service and selection* (speculative parts); *Speculative graph
coverage* for the device allocation rule. Everything here works on plain arrays of
scaled lane values ``options[i, L]`` (lane ``i`` given ``L`` target rows, ``-inf`` where
``L`` is not allowed, column 0 unused):

- ``best_lengths``: the exact host choice of a cohort of at most ``B`` lanes and one
  length per lane with lengths summing to at most ``P`` (SEL-27 for complete prefixes,
  SPEC-19 for adaptive lengths): a multiple-choice knapsack solved by dynamic
  programming over (lanes taken, rows used), after an exact pruning of lanes that at
  least ``min(B, P)`` other lanes dominate (any optimal cohort can swap such a lane for
  an unused dominator, so the pruned problem has the same optimum);
- ``frontier_allocation``: the device's causal frontier rule (SPEC-28, SPEC-29), the
  numpy twin of ``gpu/speculative/allocation.py``;
- ``prefix_cohort_values``: every prefix of one lane ordering priced with its own
  frontier allocation at once (SEL-28, SEL-29), without enumerating cohorts (SEL-30).

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from policy.utility import FloatArray, IntArray

__all__ = ["best_lengths", "clean_forecast", "frontier_allocation", "prefix_cohort_values",
           "prune_lanes"]


def prune_lanes(options: FloatArray, keep_at_most: int) -> IntArray:
    """Indices of lanes that fewer than ``keep_at_most`` other lanes dominate.

    Lane ``j`` dominates lane ``i`` when it offers every length ``i`` offers at no less
    value, and is strictly better somewhere or earlier in input order (a strict order,
    so swaps terminate). A cohort has at most ``keep_at_most`` lanes, so a lane with that
    many dominators always has a free one to swap with at no loss.
    """
    n = options.shape[0]
    if n <= keep_at_most:
        return np.arange(n, dtype=np.int64)
    mine = options[None, :, 1:]    # lane i along axis 1
    other = options[:, None, 1:]   # lane j along axis 0
    offered = np.isfinite(mine)
    covers = np.all(~offered | (other >= mine), axis=2)
    strictly = np.any(offered & (other > mine), axis=2)
    earlier = np.arange(n)[:, None] < np.arange(n)[None, :]
    dominates = covers & (strictly | earlier)
    np.fill_diagonal(dominates, False)
    kept: IntArray = np.nonzero(dominates.sum(axis=0) < keep_at_most)[0].astype(np.int64)
    return kept


def best_lengths(options: FloatArray, batch: int, total_rows: int) -> dict[int, int]:
    """``{lane: rows}`` maximising total value with at most ``batch`` lanes and at most
    ``total_rows`` rows (each chosen lane at least one row). Exact."""
    n, width = options.shape
    limit = min(batch, total_rows, n)
    if limit <= 0:
        return {}
    lanes = prune_lanes(options, limit)
    if len(lanes) <= batch:
        greedy = _concave_lengths(options[lanes], total_rows)
        if greedy is not None:
            return {int(lanes[i]): rows for i, rows in greedy.items()}
    rows_cap = total_rows
    neg = -np.inf
    best = np.full((limit + 1, rows_cap + 1), neg)
    best[0, 0] = 0.0
    picks: list[IntArray] = []
    for i in lanes.tolist():
        new = best.copy()
        pick = np.zeros(best.shape, dtype=np.int64)
        for rows in range(1, min(width - 1, rows_cap) + 1):
            value = options[i, rows]
            if not np.isfinite(value):
                continue
            seg = best[:-1, : rows_cap + 1 - rows] + value
            target = new[1:, rows:]
            better = seg > target
            np.copyto(target, seg, where=better)
            np.copyto(pick[1:, rows:], rows, where=better)
        picks.append(pick)
        best = new
    flat = int(np.argmax(best))  # first maximum: fewest lanes, then fewest rows
    k, r = divmod(flat, rows_cap + 1)
    if not np.isfinite(best[k, r]):
        return {}
    chosen: dict[int, int] = {}
    for pos in range(len(picks) - 1, -1, -1):
        rows = int(picks[pos][k, r])
        if rows:
            chosen[int(lanes[pos])] = rows
            k, r = k - 1, r - rows
    return chosen


def _concave_lengths(options: FloatArray, total_rows: int) -> dict[int, int] | None:
    """Exact lengths when the lane count cannot bind and every lane's value is concave in
    its rows (non-increasing increments from zero rows, as for non-increasing survival):
    the ``total_rows`` largest positive increments, ties by shorter prefix then lane.
    None when some lane is not concave (the dynamic program decides then)."""
    allowed = np.isfinite(options)
    allowed[:, 0] = True
    usable = np.cumprod(allowed, axis=1).astype(np.bool_)  # contiguous lengths from 0 only
    if not np.array_equal(usable, allowed):
        return None
    values = np.where(allowed, options, 0.0)
    values[:, 0] = 0.0
    steps = np.diff(values, axis=1)
    ok = allowed[:, 1:]
    later = ok[:, 1:]
    if np.any(later & (steps[:, 1:] > steps[:, :-1])):
        return None
    lane, depth = np.nonzero(ok & (steps > 0))
    gain = steps[lane, depth]
    take = np.lexsort((lane, depth, -gain))[:total_rows]
    counts = np.bincount(lane[take], minlength=options.shape[0])
    return {int(i): int(c) for i, c in enumerate(counts) if c > 0}


def frontier_allocation(forecast: FloatArray, ceilings: Sequence[int] | IntArray,
                        total_rows: int) -> list[int]:
    """Target rows per lane under the device's causal frontier rule (SPEC-28, SPEC-29).

    ``forecast`` ``[m, D]``: joint prefix probability of draft prefix ``k`` at ``k - 1``.
    Every active lane keeps its pending row; the remaining ``P - active`` rows go to
    candidates ``(lane, k)`` with ``k < ceiling`` by probability descending, then shorter
    prefix, then lower slot. Probabilities are made non-increasing per lane, so every
    prefix of that order is causally closed (see ``gpu/speculative/allocation.py``).
    """
    probs = np.clip(np.nan_to_num(np.asarray(forecast, dtype=np.float64)), 0.0, 1.0)
    m = probs.shape[0]
    ceil = np.clip(np.asarray(ceilings, dtype=np.int64), 0, probs.shape[1] + 1 if m else 0)
    active = ceil > 0
    lengths = active.astype(np.int64)
    budget = total_rows - int(active.sum())
    if m == 0 or probs.shape[1] == 0 or budget <= 0:
        return [int(x) for x in lengths]
    probs = np.minimum.accumulate(probs, axis=1)
    depth = np.broadcast_to(np.arange(1, probs.shape[1] + 1), probs.shape)
    slot = np.broadcast_to(np.arange(m)[:, None], probs.shape)
    valid = depth < ceil[:, None]
    p, d, s = probs[valid], depth[valid], slot[valid]
    order = np.lexsort((s, d, -p))[:budget]
    np.add.at(lengths, s[order], 1)
    return [int(x) for x in lengths]


def clean_forecast(forecast: FloatArray) -> FloatArray:
    """Forecast rows as the frontier rule reads them: NaN as 0, clipped to [0, 1] and
    made non-increasing along depth (a longer prefix is never likelier)."""
    probs = np.clip(np.nan_to_num(np.asarray(forecast, dtype=np.float64)), 0.0, 1.0)
    if probs.ndim == 2 and probs.shape[1]:
        probs = np.minimum.accumulate(probs, axis=1)
    return probs


def prefix_cohort_values(options: FloatArray, forecast: FloatArray, ceilings: IntArray,
                         order: IntArray, total_rows: int, *, cleaned: bool = False
                         ) -> tuple[FloatArray, IntArray]:
    """Value and rows of every cohort prefix ``order[:m]`` (m = 1..len(order)), each
    allocated by the frontier rule with slots in ``order`` (SEL-29).

    Returns ``values[m - 1]`` and ``rows[m - 1, s]`` (rows of ``order[s]``). A prefix of
    the order admits the best ``P - m`` frontier candidates among its own lanes, which is
    a prefix of one global candidate order restricted to slots below ``m``.
    ``cleaned``: ``forecast`` already went through ``clean_forecast`` (callers pricing
    many programs clean it once per decision).
    """
    size = len(order)
    lanes_ceil = ceilings[order]
    probs = forecast[order] if cleaned else clean_forecast(forecast[order])
    valid = np.arange(1, probs.shape[1] + 1)[None, :] < lanes_ceil[:, None]
    s, depth_index = np.nonzero(valid)  # row-major: slot, then depth
    p = probs[s, depth_index]
    ranked = s[np.lexsort((s, depth_index, -p))]
    cohort = np.arange(1, size + 1)
    member = ranked[None, :] < cohort[:, None]
    admitted = member & (np.cumsum(member, axis=1) <= (total_rows - cohort)[:, None])
    onehot = np.zeros((len(ranked), size), dtype=np.int64)
    onehot[np.arange(len(ranked)), ranked] = 1
    rows = (np.arange(size)[None, :] < cohort[:, None]).astype(np.int64)
    rows += admitted.astype(np.int64) @ onehot
    gathered = options[order[None, :], rows]
    values: FloatArray = np.where(rows > 0, gathered, 0.0).sum(axis=1)
    return values, rows
