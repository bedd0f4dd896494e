"""The families of the ordinary candidate table and what each decision reads of them.

``policy/candidates.py`` walks the table family by family (in table order: decode,
snapshot, prefill, scored prefill, decode-only mixed, mixed with a prompt row). This
module holds the family numbering, one table row (``Candidate``, with DUR-24's tie
key) and the per-catalog and per-estimate-version constants the walk reads as Python
lists: each family's shapes (``family_shapes``), estimates (``family_times``) and cohort
sizes per request count (``cohort_sizes``), plus the ordinary mixed dominance rule
(``dominated_by_smaller``, SEL-32, SEL-33).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from policy.utility import BoolArray, IntArray

if TYPE_CHECKING:
    from policy.catalog_index import CatalogIndex, ShapeTimes

INT64_MAX = int(np.iinfo(np.int64).max)

DECODE, SNAPSHOT, PREFILL, SCORED_PREFILL, MIXED_DECODE, MIXED_PROMPT = range(6)
_NAMES = ("decode", "snapshot", "prefill", "scored_prefill", "mixed_decode", "mixed")


class FamilyShapes(NamedTuple):
    """A family's shapes as Python lists (catalog constants): catalog positions, batch
    capacities and prompt capacities (prefill token capacity, mixed prompt capacity)."""

    shapes: list[int]
    batch: list[int]
    caps: list[int]


class FamilyTimes(NamedTuple):
    """A family's estimates (cached until an estimate changes): ``safe``/``half`` are
    the duration in ms (1.0 when unknown) and half of it, as in ``utility.value_rates``."""

    est: list[int]
    known: list[bool]
    all_known: bool
    safe: list[float]
    half: list[float]


class CohortSizes(NamedTuple):
    """Catalog constants of a cohort family for one request count: cohort size per
    shape and whether the shape is eligible (for mixed prompt steps: whether its batch
    bucket starts a run of equal cohorts)."""

    m: list[int]
    eligible: list[bool]


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


def family_shapes(catalog: CatalogIndex, kind: int) -> FamilyShapes:
    cached = catalog.family_memo.get(kind)
    if cached is None:
        idx = (catalog.decode, catalog.snapshot, catalog.prefill, catalog.scored_prefill,
               catalog.mixed_smallest_prompt, catalog.mixed)[kind]
        column = 1 if kind in (PREFILL, SCORED_PREFILL) else 2
        cached = FamilyShapes(idx.tolist(), catalog.batch[idx].tolist(),
                              catalog.capacities[idx, column].tolist())
        catalog.family_memo[kind] = cached
    return cached


def family_times(times: ShapeTimes, kind: int, shapes: list[int]) -> FamilyTimes:
    name = _NAMES[kind]
    cached = times.memo.get(name)
    if cached is None:
        est = times.estimate_ns[shapes].tolist()
        ms = [e / 1_000_000 for e in est]
        safe = [m if m > 0 else 1.0 for m in ms]
        known = [e > 0 for e in est]
        cached = FamilyTimes(est, known, all(known), safe, [s / 2.0 for s in safe])
        times.memo[name] = cached
    return cached


def cohort_sizes(catalog: CatalogIndex, kind: int, n: int) -> CohortSizes:
    """Cohort sizes and dominance of a family for ``n`` requests (catalog constants).
    Decode and snapshot: ``m = min(B, n)``; a larger B with the same cohort does the
    same work on larger capacities (SEL-32). Decode-only mixed steps: the same with the
    generic mixed dominance. Mixed prompt steps: ``m = min(B - 1, n)`` and whether the
    batch bucket starts a run of equal cohorts."""
    key = (kind, n)
    cached = catalog.cohort_memo.get(key)
    if cached is not None:
        return cached
    fam = family_shapes(catalog, kind)
    if kind == MIXED_PROMPT:
        grid = catalog.mixed_grid
        m_b = [min(b - 1, n) for b in grid.batches.tolist()]
        first_b = [i == 0 or m_b[i] != m_b[i - 1] for i in range(len(m_b))]
        cached = CohortSizes([m_b[b] for b in grid.col_b.tolist()],
                             [first_b[b] for b in grid.col_b.tolist()])
    else:
        m = [min(b, n) for b in fam.batch]
        if kind == MIXED_DECODE:
            batch = np.array(fam.batch, dtype=np.int64)
            keys = np.stack([np.full(len(m), -1), np.zeros(len(m), dtype=np.int64),
                             np.array(m, dtype=np.int64)], axis=1).astype(np.int64)
            eligible = (~dominated_by_smaller(
                keys, batch, np.array(fam.caps, dtype=np.int64))).tolist()
        else:
            eligible = [i == 0 or m[i] != m[i - 1] for i in range(len(m))]
        cached = CohortSizes(m, eligible)
    catalog.cohort_memo[key] = cached
    return cached


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
