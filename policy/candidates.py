"""The ordinary candidates of one decision as vectorised families (seed: *Useful service
and selection*, *Duration estimates*, *Mixed execution contract*).

``selection.select`` ranks every ordinary candidate; this module builds them. A
*family* is one block of the candidate table, in table order:

0. decode shapes with their top-m decoder cohort (SEL-25);
1. snapshot shapes with their top-m terminal cohort (PRE-44);
2. prefill shapes x prompt rows: tokens up to the logical end (SEL-39..41);
3. scored prefill shapes x scored prompt rows;
4. ordinary mixed shapes, decode-only (only each batch bucket's smallest prompt
   capacity: larger ones repeat its logical work and are dominated, SEL-32);
5. ordinary mixed shapes with the best prompt row plus the top B-1 decoders (MIX-18).

Each family holds only what ranking needs for every row: the scaled base value, the
F-SEL rate, the primary key (rate when measured, useful value when not, DUR-22/23) and
an eligibility mask (dominated shapes, SEL-32/33, and DUR-20 exclusions removed). The
remaining ranking columns (served requests, recency, padding: DUR-24) and the plan's
lanes are derived for the few rows that need them, the winner and exact ties, by
``Family.describe``. Per-catalog structure (cohort sizes per decoder count, the mixed
grid) and per-estimate structure (durations per family) are cached between decisions;
nothing that depends on request state is.

The previous full-table builder is kept as the executable specification in
``selection_reference.py``; both produce bit-identical decisions (tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from policy.utility import FloatArray

if TYPE_CHECKING:
    from policy.selection import CatalogIndex, DecisionContext, LaneGroup, ShapeTimes

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
INT64_MAX = int(np.iinfo(np.int64).max)

DECODE, SNAPSHOT, PREFILL, SCORED_PREFILL, MIXED_DECODE, MIXED_PROMPT = range(6)


class FamilyTimes(NamedTuple):
    """Estimates of one family's shapes (cached until an estimate changes)."""

    est_ns: IntArray
    known: BoolArray
    all_known: bool
    safe_ms: FloatArray
    """Duration in ms where known, 1.0 where not (``utility.value_rates``)."""
    half_ms: FloatArray
    """``safe_ms / 2.0``: the waiting cost factor of F-SEL."""
    est_list: list[int]


def family_times(times: ShapeTimes, name: str, idx: IntArray) -> FamilyTimes:
    cached = times.memo.get(name)
    if cached is None:
        est = times.estimate_ns[idx]
        known = est > 0
        ms = est / 1_000_000
        safe = np.where(ms > 0, ms, 1.0)
        cached = FamilyTimes(est, known, bool(known.all()), safe, safe / 2.0, est.tolist())
        times.memo[name] = cached
    return cached


class Candidate(NamedTuple):
    """One table row with every ranking column (DUR-24) and what the plan needs."""

    family: int
    flat: int
    shape: int
    base: float
    rate: float
    known: bool
    est_ns: int
    served: int
    lru: int
    pad_rows: int
    pad_tokens: int
    prompt_pos: int
    prompt_tokens: int
    n_dec: int
    n_term: int

    def tie_key(self) -> tuple[int, int, int, int, int, int, int]:
        """DUR-24's order among rows with an equal primary key (OPEN-19): shorter known
        time, more served requests, less recently served, fewer padded rows, fewer
        padded prompt tokens; then table order."""
        return (self.est_ns if self.known else 0, -self.served, self.lru, self.pad_rows,
                self.pad_tokens, self.family, self.flat)


class Family(ABC):
    """One block of candidates: ``width`` shapes per row, ``rows`` rows (prompt rows for
    prefill families, else one), arrays of shape (rows, width) flattened row-major."""

    __slots__ = (
        "base",
        "eligible",
        "kind",
        "primary",
        "rates",
        "shapes",
        "times",
        "width",
    )

    def __init__(self, kind: int, shapes: IntArray, times: FamilyTimes, base: FloatArray,
                 slope: FloatArray | None, waiting: float,
                 eligible: BoolArray | None) -> None:
        self.kind = kind
        self.shapes = shapes
        self.times = times
        self.width = len(shapes)
        self.base = base
        # ``utility.value_rates`` with the same IEEE operations (slope 0: base + 0.0 is
        # base for the positive values of prompt rows).
        numerator = base if slope is None else base + slope * times.safe_ms
        self.rates: FloatArray = numerator / times.safe_ms - times.half_ms * waiting
        self.primary: FloatArray = self.rates if times.all_known else np.where(
            times.known, self.rates, base)
        self.eligible = eligible

    @abstractmethod
    def candidate(self, flat: int, ctx: DecisionContext) -> Candidate:
        """Row ``flat`` with every ranking column and what its plan needs."""

    def _row(self, flat: int, col: int, served: int, lru: int, pad_rows: int,
             pad_tokens: int, prompt_pos: int, prompt_tokens: int, n_dec: int,
             n_term: int) -> Candidate:
        t = self.times
        return Candidate(self.kind, flat, int(self.shapes[col]), float(self.base.flat[flat]),
                         float(self.rates.flat[flat]), bool(t.known[col]), t.est_list[col],
                         served, lru, pad_rows, pad_tokens, prompt_pos, prompt_tokens,
                         n_dec, n_term)


class _CohortFamily(Family):
    """Decode or snapshot shapes: the first min(B, n) lanes of the sorted group."""

    __slots__ = ("caps", "group", "sizes")

    def __init__(self, kind: int, shapes: IntArray, times: FamilyTimes, group: LaneGroup,
                 sizes: IntArray, caps: IntArray, eligible: BoolArray,
                 waiting: float) -> None:
        slope = cast(FloatArray, sizes * group.slope)
        super().__init__(kind, shapes, times, group.prefix[sizes], slope, waiting, eligible)
        self.group, self.sizes, self.caps = group, sizes, caps

    def candidate(self, flat: int, ctx: DecisionContext) -> Candidate:
        m = int(self.sizes[flat])
        terminal = self.kind == SNAPSHOT
        return self._row(flat, flat, m, int(self.group.lru_prefix_min[m]),
                         int(self.caps[flat]) - m, 0, -1, 0, 0 if terminal else m,
                         m if terminal else 0)


class _PrefillFamily(Family):
    """Prefill shapes x prompt rows (row-major)."""

    __slots__ = ("caps", "rows", "tokens")

    def __init__(self, kind: int, shapes: IntArray, times: FamilyTimes, rows: IntArray,
                 tokens: IntArray, value: FloatArray, caps: IntArray,
                 eligible: BoolArray, waiting: float) -> None:
        super().__init__(kind, shapes, times, value, None, waiting, eligible)
        self.rows, self.tokens, self.caps = rows, tokens, caps

    def candidate(self, flat: int, ctx: DecisionContext) -> Candidate:
        r, col = divmod(flat, self.width)
        pos = int(self.rows[r])
        tokens = int(self.tokens[r, col])
        return self._row(flat, col, 1, int(ctx.prompts.last_served[pos]), 0,
                         int(self.caps[col]) - tokens, pos, tokens, 0, 0)


class _MixedDecodeFamily(Family):
    """Decode-only mixed steps at each batch bucket's smallest prompt capacity."""

    __slots__ = ("batch", "prompt_caps", "sizes")

    def __init__(self, shapes: IntArray, times: FamilyTimes, group: LaneGroup,
                 sizes: IntArray, batch: IntArray, prompt_caps: IntArray,
                 eligible: BoolArray, waiting: float) -> None:
        slope = cast(FloatArray, sizes * group.slope)
        super().__init__(MIXED_DECODE, shapes, times, group.prefix[sizes], slope, waiting,
                         eligible)
        self.sizes, self.batch, self.prompt_caps = sizes, batch, prompt_caps

    def candidate(self, flat: int, ctx: DecisionContext) -> Candidate:
        m = int(self.sizes[flat])
        return self._row(flat, flat, m, int(ctx.decoders.lru_prefix_min[m]),
                         int(self.batch[flat]) - m, int(self.prompt_caps[flat]), -1, 0, m, 0)


class _MixedPromptFamily(Family):
    """Mixed steps with the best prompt row and the top B-1 decoders (MIX-18)."""

    __slots__ = ("batch", "best_pos", "best_tokens", "prompt_caps", "sizes")

    def __init__(self, shapes: IntArray, times: FamilyTimes, base: FloatArray,
                 slope: FloatArray, sizes: IntArray, batch: IntArray, prompt_caps: IntArray,
                 best_pos: IntArray, best_tokens: IntArray, eligible: BoolArray,
                 waiting: float) -> None:
        super().__init__(MIXED_PROMPT, shapes, times, base, slope, waiting, eligible)
        self.sizes, self.batch, self.prompt_caps = sizes, batch, prompt_caps
        self.best_pos, self.best_tokens = best_pos, best_tokens

    def candidate(self, flat: int, ctx: DecisionContext) -> Candidate:
        m = int(self.sizes[flat])
        pos = int(self.best_pos[flat])
        tokens = int(self.best_tokens[flat])
        lru = int(ctx.prompts.last_served[pos])
        if m > 0:
            lru = min(lru, int(ctx.decoders.lru_prefix_min[m]))
        return self._row(flat, flat, m + 1, lru, int(self.batch[flat]) - m - 1,
                         int(self.prompt_caps[flat]) - tokens, pos, tokens, m, 0)


def dominated_by_smaller(keys: IntArray, batch: IntArray, prompt: IntArray) -> BoolArray:
    """Dominance among ordinary mixed candidates (SEL-32, SEL-33).

    Rows with equal ``keys`` (prompt row, prompt work, decoder cohort) compete; their
    physical capacities are (B, 1, C, C + B - 1), so row i is dominated exactly when
    another row of its group has B' <= B and C' <= C with one strictly smaller. Sorting
    by (group, B, C) and taking a running minimum of C within each group finds every
    such row in O(n log n) without pairwise comparison.
    """
    n = len(batch)
    result = np.zeros(n, dtype=np.bool_)
    if n < 2:
        return result
    order = np.lexsort((prompt, batch, keys[:, 2], keys[:, 1], keys[:, 0]))
    sorted_keys = keys[order]
    change = np.empty(n, dtype=np.int64)
    change[0] = 0
    change[1:] = np.any(sorted_keys[1:] != sorted_keys[:-1], axis=1)
    group = np.cumsum(change)
    big = int(prompt.max()) + 1
    shifted = prompt[order] - group * big  # later groups never leak backwards
    running = np.minimum.accumulate(shifted)
    earlier = np.empty(n, dtype=np.int64)
    earlier[0] = INT64_MAX
    earlier[1:] = running[:-1]
    result[order] = earlier <= shifted
    return result


def _cohort_sizes(catalog: CatalogIndex, name: str, idx: IntArray, n: int
                  ) -> tuple[IntArray, IntArray, BoolArray]:
    """``(m = min(B, n), B, eligible)`` for a family sorted by B: a larger B with the
    same cohort does the same work on larger capacities and is dominated (SEL-32)."""
    key = (name, n)
    cached = catalog.cohort_memo.get(key)
    if cached is None:
        cap = catalog.batch[idx]
        m = np.minimum(cap, n)
        eligible = np.ones(len(idx), dtype=np.bool_)
        eligible[1:] = m[1:] != m[:-1]
        cached = catalog.cohort_memo[key] = (m, cap, eligible)
    return cached


def _mixed_decode_sizes(catalog: CatalogIndex, n: int) -> tuple[IntArray, BoolArray]:
    """Decode-only mixed rows: cohort sizes and eligibility (their keys differ only by
    the cohort size, so dominance depends on the decoder count alone)."""
    key = ("mixed_decode", n)
    cached = catalog.cohort_memo.get(key)
    if cached is None:
        only = catalog.mixed_smallest_prompt
        batch = catalog.batch[only]
        m = np.minimum(batch, n)
        keys = np.stack([np.full(len(only), -1), np.zeros(len(only), dtype=np.int64), m],
                        axis=1).astype(np.int64)
        eligible = ~dominated_by_smaller(keys, batch, catalog.capacities[only, 2])
        cached = catalog.cohort_memo[key] = (m, batch, eligible)
    return cached[0], cached[2]


def _mixed_prompt_sizes(catalog: CatalogIndex, n: int) -> tuple[IntArray, BoolArray]:
    """``m2 = min(B - 1, n)`` per mixed column and whether its batch bucket starts a run
    of equal cohorts (the grid dominance rule along B)."""
    key = ("mixed_prompt", n)
    cached = catalog.cohort_memo.get(key)
    if cached is None:
        grid = catalog.mixed_grid
        m_b = np.minimum(grid.batches - 1, n)
        first_b = np.ones(len(m_b), dtype=np.bool_)
        first_b[1:] = m_b[1:] != m_b[:-1]
        cached = catalog.cohort_memo[key] = (m_b[grid.col_b], grid.batches[grid.col_b],
                                             first_b[grid.col_b])
    return cached[0], cached[2]


def candidate_families(ctx: DecisionContext) -> list[Family]:
    """Every ordinary candidate family of the decision, in table order."""
    cat = ctx.catalog
    times = ctx.times
    waiting = ctx.waiting
    dec, term, p = ctx.decoders, ctx.terminals, ctx.prompts
    n_dec = len(dec)
    out: list[Family] = []
    for kind, name, idx, group in ((DECODE, "decode", cat.decode, dec),
                                   (SNAPSHOT, "snapshot", cat.snapshot, term)):
        if len(idx) and len(group):
            sizes, caps, eligible = _cohort_sizes(cat, name, idx, len(group))
            out.append(_CohortFamily(kind, idx, family_times(times, name, idx), group,
                                     sizes, caps, eligible, waiting))
    if not p.records:
        if n_dec and len(cat.mixed):
            out.append(_mixed_decode_family(ctx))
        return out
    # One value table for every prompt row at every distinct prompt capacity of the
    # prefill, scored prefill and mixed families (SEL-39..41).
    layout = cat.prompt_layout
    rem = p.logical_remaining[:, None]
    tokens_u = np.minimum(layout.caps[None, :], rem)
    final_u = (tokens_u == rem) & p.reaches_prompt_end[:, None]
    value_u = tokens_u * p.token_price[:, None] + final_u * p.finish_value[:, None]
    n_scored = len(p.scored_rows)
    ordinary_rows = p.ordinary_rows
    for kind, name, idx, cols, rows in (
            (PREFILL, "prefill", cat.prefill, layout.prefill_cols, ordinary_rows),
            (SCORED_PREFILL, "scored_prefill", cat.scored_prefill, layout.scored_cols,
             p.scored_rows)):
        if not len(idx) or not len(rows):
            continue
        out.append(_prefill_family(ctx, kind, name, idx, cols, rows, tokens_u, value_u,
                                   all_rows=len(rows) == len(p.records)))
    if len(cat.mixed) and (n_dec or n_scored < len(p.records)):
        if n_dec:
            out.append(_mixed_decode_family(ctx))
        if n_scored < len(p.records):
            out.append(_mixed_prompt_family(ctx, tokens_u, value_u, ordinary_rows,
                                            all_rows=n_scored == 0))
    return out


def _prefill_family(ctx: DecisionContext, kind: int, name: str, idx: IntArray,
                    cols: IntArray | None, rows: IntArray, tokens_u: IntArray,
                    value_u: FloatArray, *, all_rows: bool) -> Family:
    p = ctx.prompts
    t = family_times(ctx.times, name, idx)
    tokens = tokens_u if all_rows else tokens_u[rows]
    value = value_u if all_rows else value_u[rows]
    if cols is not None:
        tokens, value = tokens[:, cols], value[:, cols]
    caps = ctx.catalog.capacities[idx, 1]
    eligible = np.ones(tokens.shape, dtype=np.bool_)
    # A larger capacity consuming the same tokens is dominated (SEL-32).
    np.not_equal(tokens[:, 1:], tokens[:, :-1], out=eligible[:, 1:])
    if not t.all_known:
        # DUR-20: a smaller capacity already covers everything up to the next endpoint.
        unknown = ~t.known
        eligible[:, 1:] &= ~(unknown[None, 1:] & (
            caps[None, :-1] >= p.endpoint_remaining[rows][:, None]))
    return _PrefillFamily(kind, idx, t, rows, tokens, value, caps, eligible, ctx.waiting)


def _mixed_decode_family(ctx: DecisionContext) -> Family:
    cat = ctx.catalog
    only = cat.mixed_smallest_prompt
    sizes, eligible = _mixed_decode_sizes(cat, len(ctx.decoders))
    return _MixedDecodeFamily(only, family_times(ctx.times, "mixed_decode", only),
                              ctx.decoders, sizes, cat.batch[only],
                              cat.capacities[only, 2], eligible, ctx.waiting)


def _mixed_prompt_family(ctx: DecisionContext, tokens_u: IntArray, value_u: FloatArray,
                         rows: IntArray, *, all_rows: bool) -> Family:
    cat = ctx.catalog
    grid = cat.mixed_grid
    dec = ctx.decoders
    idx = cat.mixed
    # Best ordinary prompt row per distinct prompt capacity; rows are ordered least
    # recently served first, so argmax's first maximum is the DUR-24 tie-break.
    value_c = (value_u if all_rows else value_u[rows])[:, grid.caps_u]
    tokens_c = (tokens_u if all_rows else tokens_u[rows])[:, grid.caps_u]
    best_c = np.argmax(value_c, axis=0)
    cols_c = np.arange(len(best_c))
    best_value_c = value_c[best_c, cols_c]
    best_tokens_c = tokens_c[best_c, cols_c]
    sizes, first_b = _mixed_prompt_sizes(cat, len(dec))
    col_c = grid.col_c
    base = best_value_c[col_c] + dec.prefix[sizes]
    best_tokens = best_tokens_c[col_c]
    best_pos = rows[best_c[col_c]]
    if grid.full:
        # Equal work forms runs along C (same best row, same tokens) and along B (same
        # cohort); on a complete grid a column is undominated exactly when it starts
        # both runs (SEL-32, SEL-33).
        first_c = np.ones(len(best_c), dtype=np.bool_)
        first_c[1:] = (best_c[1:] != best_c[:-1]) | (best_tokens_c[1:] != best_tokens_c[:-1])
        eligible = first_b & first_c[col_c]
    else:
        keys = np.stack([best_pos, best_tokens, sizes], axis=1)
        eligible = ~dominated_by_smaller(keys, cat.batch[idx], cat.capacities[idx, 2])
    slope = cast(FloatArray, sizes * dec.slope)
    return _MixedPromptFamily(idx, family_times(ctx.times, "mixed", idx), base, slope, sizes, cat.batch[idx],
                              cat.capacities[idx, 2], best_pos, best_tokens, eligible,
                              ctx.waiting)


def best_candidate(ctx: DecisionContext, families: list[Family]) -> Candidate | None:
    """The ordinary winner: unknown durations first by useful value (DUR-22, DUR-23),
    else the highest F-SEL rate; exact ties by ``Candidate.tie_key``. None when every
    row is dominated or excluded."""
    unknown_pool = False
    for f in families:
        if not f.times.all_known:
            unknown = ~f.times.known if f.eligible is None else f.eligible & ~f.times.known
            if unknown.any():
                unknown_pool = True
                break
    masks: list[BoolArray | None] = []
    tops: list[float] = []
    for f in families:
        mask = f.eligible
        if unknown_pool:
            mask = ~np.broadcast_to(f.times.known, f.primary.shape) if mask is None \
                else mask & ~f.times.known
        masks.append(mask)
        tops.append(float(f.primary.max(where=mask, initial=-np.inf)) if mask is not None
                    else float(f.primary.max()))
    best = max(tops)
    if best == -np.inf:
        return None
    tied: list[Candidate] = []
    for f, mask, top in zip(families, masks, tops, strict=True):
        if top != best:
            continue
        hit = f.primary == best
        if mask is not None:
            hit &= mask
        for flat in np.flatnonzero(hit).tolist():
            tied.append(f.candidate(flat, ctx))
    return tied[0] if len(tied) == 1 else min(tied, key=Candidate.tie_key)


def refresh_candidate(ctx: DecisionContext, families: list[Family], winner_shape: int
                      ) -> Candidate | None:
    """The funded refresh alternative (REF-7, REF-8, OPEN-9, SEL-37): among rows of
    stale shapes other than the winner's, dominated ones included, the least recently
    touched first, then the ordinary ranking. None when there is none.

    Stale implies measured, and only unmeasured prefill rows are DUR-20 exclusions, so
    no excluded row can qualify."""
    stale_all = ctx.stale
    touched = ctx.last_touched_ns
    pool: list[tuple[int, float, Family, int]] = []
    for f in families:
        cols = stale_all[f.shapes] & (f.shapes != winner_shape)
        if not cols.any():
            continue
        hit = np.broadcast_to(cols, f.primary.shape)
        for flat in np.flatnonzero(hit).tolist():
            col = flat % f.width
            pool.append((int(touched[f.shapes[col]]), -float(f.primary.flat[flat]), f, flat))
    if not pool:
        return None
    first = min((lt, neg) for lt, neg, _, _ in pool)
    tied = [f.candidate(flat, ctx) for lt, neg, f, flat in pool if (lt, neg) == first]
    return min(tied, key=Candidate.tie_key)
