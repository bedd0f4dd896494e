"""The inputs of one decision, as the selector reads them (seed: *Useful service and
selection*, *Duration estimates*, *Prerequisites and completion*).

This module owns the data types between ``decision.build_context`` and
``selection.select``:

- ``CatalogIndex``: the loaded catalog grouped by candidate family, each sorted by
  capacity, with the structure that stays fixed while the catalog does (the prompt
  capacities shared by the prefill and mixed families, the mixed grid) and memos of
  per-catalog constants (cohort sizes and dominance per request count, the lookahead
  templates);
- ``ShapeTimes``: per-shape estimates, freshness and attempt times, with memos of
  what derives from the estimates (per-family durations, reference intervals, the
  lookahead's spans) and a stale mask kept valid until a shape crosses its freshness
  boundary (DUR-10, OPEN-11);
- ``LaneGroup``, ``PromptGroup``, ``RestoreGroup``: the runnable requests by role, with
  their scaled values (SEL-5..7, SEL-14..20, PRE-44);
- ``DecisionContext``: everything one decision needs.

Memos never hold anything that depends on request state; ``ShapeTimes.update`` drops
the estimate-derived ones when an estimate changes.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from policy.descriptors import GraphKind, GraphShape, StateOp
from policy.requests import RequestRecord
from policy.utility import FloatArray

if TYPE_CHECKING:
    from policy.candidate_families import CohortSizes, FamilyShapes, FamilyTimes
    from policy.prerequisite_pairs import FollowingTemplate, PairLists

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
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
            self.memo.clear()
            self.sigma_memo.clear()
            self.pair_lists_memo.clear()
            self._restage(i)
        if int(self.last_valid_ns[i]) != last_valid_ns:
            self.last_valid_ns[i] = last_valid_ns
            self._restage(i)
        self.last_touched_ns[i] = last_touched_ns

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


class LaneGroup:
    """Requests of one role sorted by descending base value (ties: least recently
    served first, then handle). A cohort of size m is the first m; its value is a prefix
    sum. Kept as Python lists (the selector walks them as floats); the numpy views
    ``base``/``prefix``/``lru_prefix_min`` are built on first use."""

    __slots__ = ("_arrays", "base_list", "lru_list", "prefix_list", "records", "slope")

    def __init__(self, records: tuple[RequestRecord, ...], base: list[float], slope: float,
                 prefix: list[float], lru: list[int]) -> None:
        self.records = records
        self.base_list = base
        self.slope = slope
        """Per-lane age slope ``c*sigma`` (scaled); uniform within a group."""
        self.prefix_list = prefix
        """``prefix_list[m]``: the summed base values of the first m lanes."""
        self.lru_list = lru
        """``lru_list[m]`` = least last-served time among the first m (m >= 1)."""
        self._arrays: dict[str, npt.NDArray[np.generic]] = {}

    @staticmethod
    def build(records: list[RequestRecord], base: list[float], slope: float,
              *, served: list[int] | None = None, handles: list[int] | None = None
              ) -> LaneGroup:
        """Sort ``records`` by descending ``base``, then least recently served, then
        handle. ``served``/``handles``: their ``last_served_ns`` and handles when the
        caller already has them. Prefix sums add in order, as ``utility.prefix_sums``."""
        n = len(records)
        if not n:  # common for terminals
            return LaneGroup((), [], slope, [0.0], [0])
        if served is None:
            served = [r.last_served_ns for r in records]
        if handles is None:
            handles = [r.handle for r in records]
        # Descending values (a reverse sort keeps equal values in order); equal values
        # go least recently served first, then by handle (DUR-24).
        order = sorted(range(n), key=base.__getitem__, reverse=True)
        if len(set(base)) < n:
            order = [i for _, _, _, i in sorted(zip([-v for v in base], served, handles,
                                                     range(n), strict=True))]
        if n == 1:
            return LaneGroup((records[0],), [base[0]], slope, [0.0, base[0]], [0, served[0]])
        pick = operator.itemgetter(*order)
        values = list(pick(base))
        return LaneGroup(pick(records), values, slope, [0.0, *itertools.accumulate(values)],
                         [0, *itertools.accumulate(pick(served), min)])

    def __len__(self) -> int:
        return len(self.records)

    def _array(self, name: str, values: list[float] | list[int],
               dtype: type[np.generic]) -> npt.NDArray[np.generic]:
        cached = self._arrays.get(name)
        if cached is None:
            cached = self._arrays[name] = np.array(values, dtype=dtype)
        return cached

    @property
    def base(self) -> FloatArray:
        return cast(FloatArray, self._array("base", self.base_list, np.float64))

    @property
    def prefix(self) -> FloatArray:
        return cast(FloatArray, self._array("prefix", self.prefix_list, np.float64))

    @property
    def lru_prefix_min(self) -> IntArray:
        return cast(IntArray, self._array("lru", self.lru_list, np.int64))


class PromptGroup:
    """Requests with prompt work, least recently served first (one entry per request),
    as Python lists; the numpy views (``logical_remaining`` ...) are built on first use.

    ``remaining``: tokens up to the logical end (system boundary or prompt end,
    SEL-40); ``endpoint``: up to the next message or prompt endpoint (DUR-20);
    ``reaches``: consuming all of ``remaining`` finishes the prompt; ``price``: the
    scaled prefill token price ``1 + f/x``; ``finish``: the scaled value of the first
    output (output token price + delivery price); ``ordinary``/``scored_list``: the
    positions of the rows without and with scoring."""

    __slots__ = ("_arrays", "cursor_list", "endpoint", "finish", "last_served_list",
                 "ordinary", "price", "reaches", "records", "remaining", "scored_list")

    def __init__(self, records: tuple[RequestRecord, ...], *, cursor: list[int],
                 remaining: list[int], endpoint: list[int], reaches: list[bool],
                 price: list[float], finish: list[float], last_served: list[int],
                 scored: list[int]) -> None:
        self.records = records
        self.cursor_list = cursor
        self.remaining = remaining
        self.endpoint = endpoint
        self.reaches = reaches
        self.price = price
        self.finish = finish
        self.last_served_list = last_served
        self.scored_list = scored
        self.ordinary = [i for i in range(len(records)) if i not in scored] if scored \
            else list(range(len(records)))
        self._arrays: dict[str, npt.NDArray[np.generic]] = {}

    def _array(self, name: str, values: list[float] | list[int] | list[bool],
               dtype: type[np.generic]) -> npt.NDArray[np.generic]:
        cached = self._arrays.get(name)
        if cached is None:
            cached = self._arrays[name] = np.array(values, dtype=dtype)
        return cached

    @property
    def cursor(self) -> IntArray:
        return cast(IntArray, self._array("cursor", self.cursor_list, np.int64))

    @property
    def logical_remaining(self) -> IntArray:
        return cast(IntArray, self._array("remaining", self.remaining, np.int64))

    @property
    def endpoint_remaining(self) -> IntArray:
        return cast(IntArray, self._array("endpoint", self.endpoint, np.int64))

    @property
    def reaches_prompt_end(self) -> BoolArray:
        return cast(BoolArray, self._array("reaches", self.reaches, np.bool_))

    @property
    def token_price(self) -> FloatArray:
        return cast(FloatArray, self._array("price", self.price, np.float64))

    @property
    def finish_value(self) -> FloatArray:
        return cast(FloatArray, self._array("finish", self.finish, np.float64))

    @property
    def last_served(self) -> IntArray:
        return cast(IntArray, self._array("last_served", self.last_served_list, np.int64))

    @property
    def scored(self) -> BoolArray:
        cached = self._arrays.get("scored")
        if cached is None:
            cached = np.zeros(len(self.records), dtype=np.bool_)
            cached[self.scored_list] = True
            self._arrays["scored"] = cached
        return cast(BoolArray, cached)

    @property
    def ordinary_rows(self) -> IntArray:
        return cast(IntArray, self._array("ordinary", self.ordinary, np.int64))

    @property
    def scored_rows(self) -> IntArray:
        return cast(IntArray, self._array("scored_rows", self.scored_list, np.int64))


@dataclass(slots=True)
class RestoreGroup:
    """Prerequisite-ready requests (newly ready rows of a prerequisite pair, PRE-7, or
    continuations of a longer chain, PRE-21), with their scaled lane values as decoders
    (``decoding``) or as prompt rows."""

    records: tuple[RequestRecord, ...]
    decoding: tuple[bool, ...]
    base: tuple[float, ...]
    """Decoder value at the planning start (age so far, with the row's own slope); 0
    for prompt rows."""
    slope: float
    """The family age slope of single-stage decoders (SEL-16)."""
    token_price: tuple[float, ...]
    finish_value: tuple[float, ...]
    remaining: tuple[int, ...]
    """Prompt tokens up to the logical end; 0 for decoders."""
    next_op: tuple[StateOp, ...] = ()
    """The prerequisite stage each row needs next."""
    multistage: tuple[bool, ...] = ()
    """Whether further prerequisite stages follow the next one (PRE-21)."""
    slopes: tuple[float, ...] = ()
    """Each row's own age slope: the family slope, or for a multistage decoder
    ``c * sigma_i`` with its individual future-delivery reference (SEL-18, OPEN-15)."""
    further_ms: tuple[float, ...] = ()
    """Fastest measured duration of the stages after the next one plus the row's first
    inference (F of the continuation index, PRE-21, PRE-23); unknown stages count 0.
    Only multistage rows use it; a single-stage prompt row's first chunk is not
    searched (0 there)."""
    continuation_value: tuple[float, ...] = ()
    """A multistage prompt row's value in its first prefill chunk (0 for decoders and
    single-stage rows)."""

    def continuation(self, i: int, first_ms: float) -> tuple[float, float]:
        """``(V, F)`` of row ``i`` for a prerequisite of duration ``first_ms``: a decoder's
        value ages to ``T + F`` with its own slope; a prompt row's is its first chunk."""
        further = self.further_ms[i]
        if self.decoding[i]:
            return self.base[i] + self.slopes[i] * (first_ms + further), further
        return self.continuation_value[i], further


@dataclass(slots=True)
class DecisionContext:
    """Everything one decision needs, already projected and scaled (read-only by
    convention; not frozen because it is built on every decision)."""

    catalog: CatalogIndex
    times: ShapeTimes
    estimate_ns: IntArray
    stale: BoolArray
    last_touched_ns: IntArray
    decoders: LaneGroup
    terminals: LaneGroup
    prompts: PromptGroup
    restorable: RestoreGroup
    waiting: float
    """Scaled sum of c_i over active decoders and pending terminals (SEL-19, PRE-45)."""
    terminal_coefficient: float
    """Scaled ``terminal_age_price``: a terminal row's share of ``waiting`` (PRE-46)."""
    exponent: int
    now_ns: int
    start_ns: int
    refresh_funded: bool
