"""What every decision reads of the loaded catalog and its estimates (seed: *Useful
service and selection*, *Duration estimates*).

- ``CatalogIndex``: the loaded catalog grouped by candidate family, each sorted by
  capacity, with the structure that stays fixed while the catalog does (the prompt
  capacities shared by the prefill and mixed families, ``PromptLayout``; the mixed
  grid, ``MixedGrid``) and memos of per-catalog constants (cohort sizes and dominance
  per request count, the lookahead templates);
- ``ShapeTimes``: per-shape estimates, freshness and attempt times, with memos of what
  derives from the estimates (per-family durations, reference intervals, the
  lookahead's spans) and a stale mask kept valid until a shape crosses its freshness
  boundary (DUR-10, OPEN-11).

Memos never hold anything that depends on request state; ``ShapeTimes.update`` drops
the estimate-derived ones when an estimate changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from policy.descriptors import GraphKind, GraphShape, StateOp
from policy.utility import BoolArray, IntArray

if TYPE_CHECKING:
    from policy.candidate_families import CohortSizes, FamilyShapes, FamilyTimes
    from policy.prerequisite_pairs import FollowingTemplate, PairLists

_INT64_MAX = int(np.iinfo(np.int64).max)
_INT64_MIN = int(np.iinfo(np.int64).min)


class PromptLayout(NamedTuple):
    """Every distinct prompt capacity of the prefill, scored prefill and mixed shapes,
    so one value table serves all three families; ``*_cols`` map a family's shapes to
    its columns (None: the family's capacities are exactly ``caps``)."""

    caps: IntArray
    prefill_cols: IntArray | None
    scored_cols: IntArray | None
    prefill_caps: IntArray
    scored_caps: IntArray


class MixedGrid(NamedTuple):
    """The ordinary mixed shapes (sorted by B, then C) as a grid of batch buckets x
    prompt capacities: ``col_b``/``col_c`` index ``batches`` and the distinct prompt
    capacities (``caps_u``: their columns in ``PromptLayout.caps``). ``full``: every
    (B, C) combination is loaded exactly once, which makes dominance separable."""

    batches: IntArray
    col_b: IntArray
    caps_u: IntArray
    col_c: IntArray
    full: bool
    batch: IntArray
    """Each mixed shape's batch capacity B."""
    prompt_caps: IntArray
    """Each mixed shape's prompt capacity C."""
    cols_u: IntArray
    """``arange`` over the distinct prompt capacities."""
    caps_list: list[int]
    """The distinct prompt capacities."""
    col_c_list: list[int]


@dataclass(frozen=True, slots=True)
class CatalogIndex:
    """The loaded catalog grouped by candidate family, each sorted by capacity."""

    shapes: tuple[GraphShape, ...]
    decode: IntArray
    prefill: IntArray
    scored_prefill: IntArray
    mixed: IntArray
    snapshot: IntArray
    capacities: IntArray
    """``shapes[i].capacities()`` as rows (for dominance)."""
    batch: IntArray
    """``shapes[i].batch_capacity``."""
    position: dict[GraphShape, int]
    """Index of each shape in ``shapes``."""
    mixed_smallest_prompt: IntArray
    """For each batch bucket of ``mixed``, its shape with the smallest prompt capacity."""
    restore: IntArray
    """Restore state operations, by batch capacity (prerequisites, PRE-1)."""
    initialize: IntArray
    """Initialization state operations, by batch capacity (prerequisites, PRE-1)."""
    delivery_family: IntArray
    """Decode and mixed shapes: the delivery reference family (SEL-16, MIX-23)."""
    vision: IntArray
    """Vision programs, by image capacity (prerequisites, ``vision_prerequisites``)."""
    prompt_layout: PromptLayout
    mixed_grid: MixedGrid
    cohort_memo: dict[tuple[int, int], CohortSizes] = field(
        default_factory=dict, compare=False, repr=False)
    """Cohort sizes and dominance per (family, request count): catalog constants."""
    family_memo: dict[int, FamilyShapes] = field(
        default_factory=dict, compare=False, repr=False)
    """Each candidate family's shapes and capacities as Python lists."""
    following_memo: dict[tuple[bool, bool, bool], FollowingTemplate] = field(
        default_factory=dict, compare=False, repr=False)
    """Prerequisite lookahead columns per MIX-25 case combination."""
    single_prompt_memo: dict[tuple[int, int, int], tuple[list[int], list[bool], list[bool]]] \
        = field(default_factory=dict, compare=False, repr=False)
    """A newly ready prompt row's tokens per lookahead column, by remaining tokens."""
    single_columns_memo: dict[tuple[int, int, int, int], list[tuple[int, int, int, bool]]] \
        = field(default_factory=dict, compare=False, repr=False)
    """Its kept lookahead columns, by remaining tokens and template."""

    @staticmethod
    def build(shapes: tuple[GraphShape, ...]) -> CatalogIndex:
        def pick(pred: Callable[[GraphShape], bool],
                 key: Callable[[GraphShape], tuple[int, ...] | int]) -> IntArray:
            idx = [i for i, s in enumerate(shapes) if pred(s)]
            idx.sort(key=lambda i: key(shapes[i]))
            return np.array(idx, dtype=np.int64)

        # Width-one mixed programs: ordinary rows, with draft-state maintenance in a
        # speculative load (MIX-6, MIX-35) and without in an ordinary one (MIX-44); a
        # loaded catalog holds one variant. Wider ones: ``policy/mixed_rounds.py``.
        mixed = pick(
            lambda s: s.kind is GraphKind.MIXED and s.token_capacity == 1,
            lambda s: (s.batch_capacity, s.prefill_capacity),
        )
        prefill = pick(lambda s: s.kind is GraphKind.PREFILL, lambda s: s.token_capacity)
        scored = pick(lambda s: s.kind is GraphKind.SCORED_PREFILL, lambda s: s.token_capacity)
        layout, grid = _prompt_structure(shapes, prefill, scored, mixed)
        return CatalogIndex(
            shapes=shapes,
            decode=pick(lambda s: s.kind is GraphKind.DECODE, lambda s: s.batch_capacity),
            prefill=prefill,
            scored_prefill=scored,
            mixed=mixed,
            snapshot=pick(
                lambda s: s.kind is GraphKind.STATE and s.state_op is StateOp.SNAPSHOT,
                lambda s: s.batch_capacity,
            ),
            capacities=np.array(
                [s.capacities() for s in shapes] or np.zeros((0, 4)), dtype=np.int64
            ).reshape(len(shapes), 4),
            batch=np.array([s.batch_capacity for s in shapes], dtype=np.int64),
            position={s: i for i, s in enumerate(shapes)},
            mixed_smallest_prompt=_smallest_prompt_per_batch(shapes, mixed),
            restore=pick(
                lambda s: s.kind is GraphKind.STATE and s.state_op is StateOp.RESTORE,
                lambda s: s.batch_capacity,
            ),
            initialize=pick(
                lambda s: s.kind is GraphKind.STATE and s.state_op is StateOp.INITIALIZE,
                lambda s: s.batch_capacity,
            ),
            delivery_family=pick(
                lambda s: s.kind in (GraphKind.DECODE, GraphKind.MIXED),
                lambda s: s.batch_capacity,
            ),
            vision=pick(lambda s: s.kind is GraphKind.VISION, lambda s: s.batch_capacity),
            prompt_layout=layout,
            mixed_grid=grid,
        )


def _smallest_prompt_per_batch(shapes: tuple[GraphShape, ...], mixed: IntArray) -> IntArray:
    best: dict[int, int] = {}
    for i in mixed.tolist():  # sorted by (B, C): the first of each B is the smallest C
        best.setdefault(shapes[i].batch_capacity, i)
    return np.array(sorted(best.values()), dtype=np.int64)


def _prompt_structure(shapes: tuple[GraphShape, ...], prefill: IntArray, scored: IntArray,
                      mixed: IntArray) -> tuple[PromptLayout, MixedGrid]:
    """The shared prompt-capacity table and the mixed grid (see their classes)."""
    token_caps = [shapes[i].token_capacity for i in prefill.tolist()]
    scored_caps = [shapes[i].token_capacity for i in scored.tolist()]
    mixed_bc = [(shapes[i].batch_capacity, shapes[i].prefill_capacity)
                for i in mixed.tolist()]
    caps = sorted({*token_caps, *scored_caps, *(c for _, c in mixed_bc)})
    where = {c: j for j, c in enumerate(caps)}

    def columns(family: list[int]) -> IntArray | None:
        return None if family == caps else np.array([where[c] for c in family],
                                                    dtype=np.int64)

    batches = sorted({b for b, _ in mixed_bc})
    mixed_caps = sorted({c for _, c in mixed_bc})
    grid = MixedGrid(
        batches=np.array(batches, dtype=np.int64),
        col_b=np.array([batches.index(b) for b, _ in mixed_bc], dtype=np.int64),
        caps_u=np.array([where[c] for c in mixed_caps], dtype=np.int64),
        col_c=np.array([mixed_caps.index(c) for _, c in mixed_bc], dtype=np.int64),
        full=len(set(mixed_bc)) == len(mixed_bc) == len(batches) * len(mixed_caps),
        batch=np.array([b for b, _ in mixed_bc], dtype=np.int64),
        prompt_caps=np.array([c for _, c in mixed_bc], dtype=np.int64),
        cols_u=np.arange(len(mixed_caps)),
        caps_list=mixed_caps,
        col_c_list=[mixed_caps.index(c) for _, c in mixed_bc],
    )
    layout = PromptLayout(np.array(caps, dtype=np.int64), columns(token_caps),
                          columns(scored_caps), np.array(token_caps, dtype=np.int64),
                          np.array(scored_caps, dtype=np.int64))
    return layout, grid


@dataclass(frozen=True, slots=True)
class ShapeTimes:
    """Per-shape timing state, aligned with ``CatalogIndex.shapes`` (0 / -1 = never).

    ``memo`` and the stale cache hold values derived from the estimates (per-family
    durations, reference intervals); ``update`` is the only writer of the arrays and
    drops them whenever an estimate or a freshness time changes."""

    estimate_ns: IntArray
    last_valid_ns: IntArray
    last_touched_ns: IntArray
    memo: dict[str, FamilyTimes] = field(default_factory=dict, compare=False, repr=False)
    sigma_memo: dict[tuple[str, int], float | None] = field(
        default_factory=dict, compare=False, repr=False)
    pair_lists_memo: dict[tuple[int, ...], PairLists] = field(
        default_factory=dict, compare=False, repr=False)
    stale_cache: list[tuple[int, int, int, BoolArray]] = field(
        default_factory=list, compare=False, repr=False)

    def stale(self, now_ns: int, ttl_ns: int) -> BoolArray:
        """Known and ``now - last valid >= ttl`` (DUR-10, OPEN-11)."""
        result: BoolArray = (self.estimate_ns > 0) & (self.last_valid_ns >= 0) & (
            now_ns - self.last_valid_ns >= ttl_ns)
        return result

    def stale_at(self, now_ns: int, ttl_ns: int) -> BoolArray:
        """``stale(now_ns, ttl_ns)``, shared (do not modify it) and recomputed only when
        ``now_ns`` crosses a shape's freshness boundary ``last_valid + ttl``."""
        if self.stale_cache:
            ttl, lo, hi, cached = self.stale_cache[0]
            if ttl == ttl_ns and lo <= now_ns < hi:
                return cached
        result = self.stale(now_ns, ttl_ns)
        boundary = np.where((self.estimate_ns > 0) & (self.last_valid_ns >= 0),
                            self.last_valid_ns + ttl_ns, _INT64_MAX)
        passed = boundary[boundary <= now_ns]
        ahead = boundary[boundary > now_ns]
        lo = int(passed.max()) if len(passed) else _INT64_MIN
        hi = int(ahead.min()) if len(ahead) else _INT64_MAX
        self.stale_cache[:] = [(ttl_ns, lo, hi, result)]
        return result

    def update(self, i: int, estimate_ns: int, last_valid_ns: int,
               last_touched_ns: int) -> None:
        """Set shape ``i``'s entries; derived values go when what they derive from (its
        estimate; for staleness also its last valid observation) changed."""
        if int(self.estimate_ns[i]) != estimate_ns:
            self.estimate_ns[i] = estimate_ns
            self._drop_derived()
            self._restage(i)
        if int(self.last_valid_ns[i]) != last_valid_ns:
            self.last_valid_ns[i] = last_valid_ns
            self._restage(i)
        self.last_touched_ns[i] = last_touched_ns

    def set_estimates(self, estimates_ns: Sequence[int]) -> None:
        """Set every shape's estimate at once (a shared speed factor moved them all);
        derived values go if any changed, the stale cache too if a shape became known
        or unknown."""
        new = np.array(estimates_ns, dtype=np.int64)
        if np.array_equal(new, self.estimate_ns):
            return
        if not np.array_equal(new > 0, self.estimate_ns > 0):
            self.stale_cache.clear()
        self.estimate_ns[:] = new
        self._drop_derived()

    def _drop_derived(self) -> None:
        self.memo.clear()
        self.sigma_memo.clear()
        self.pair_lists_memo.clear()

    def _restage(self, i: int) -> None:
        """Keep the stale cache valid after shape ``i``'s entries changed: over the
        cached interval [lo, hi) the shape is stale throughout when its new freshness
        boundary is at or before lo, else fresh until the boundary, which then bounds
        the interval (copy on write: decisions already built keep their array)."""
        if not self.stale_cache:
            return
        ttl, lo, hi, cached = self.stale_cache[0]
        boundary = _INT64_MAX
        if self.estimate_ns[i] > 0 and self.last_valid_ns[i] >= 0:
            boundary = int(self.last_valid_ns[i]) + ttl
        updated = cached.copy()
        updated[i] = boundary <= lo
        self.stale_cache[0] = (ttl, lo, hi if boundary <= lo else min(hi, boundary), updated)
