"""Candidates and selection for one decision (seed module ``policy.rs``).

This module owns the ordinary selector: given a ``DecisionContext`` (scaled lane values
of the runnable requests, built by ``policy/decision.py``) and the catalog, it builds
every candidate as one row of a numpy table, discards dominated and excluded rows, ranks
the rest and returns the winner as a frozen ``ScheduledPlan``.

Rules implemented here (seed: *Useful service and selection*, *Duration estimates*,
*Funded timing refresh*, *Mixed execution contract*):

- every loaded capacity competes (SEL-24, SEL-36, SEL-42, SEL-43); prefill capacities
  earn only the tokens they can consume up to the logical end (SEL-39..41);
- cohorts are the highest additive lane values (SEL-25): decoders and terminal rows are
  sorted once, so a cohort of size m is the first m of that order and its value is a
  prefix sum (no subset enumeration, SEL-38); at most 64 rows (SEL-31);
- mixed shapes compare the best decode-only cohort with the best prompt row plus the
  highest-value decoders fitting the remaining rows (MIX-18..21);
- dominance: same kind, cohort and logical work -> drop any shape whose capacities are
  all >= another's with one strictly larger (SEL-32, SEL-33, SEL-35);
- prefill exploration excludes a larger unmeasured graph when a smaller capacity covers
  the tokens up to the next message or prompt endpoint (DUR-20, OPEN-30);
- ranking: unknown durations first, by useful value (DUR-22, DUR-23); known ones by F-SEL
  value rate; ties by shorter known time, more served requests, less recently used
  requests, smaller padding (DUR-24, OPEN-19);
- funded timing refresh: with full credit, the least recently touched stale alternative
  displaces a measured winner (REF-7, REF-8, OPEN-9); refresh candidates may include
  padded (dominated) shapes because refresh is separate from ordinary selection (SEL-37).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policy.descriptors import GraphKind, GraphShape, StateOp
from policy.prerequisites import PrerequisiteChoice, best_prerequisite
from policy.requests import RequestRecord
from policy.types import (
    DecodeMode,
    Lane,
    LaneRole,
    MixedRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.utility import NS_PER_MS, FloatArray, optimistic_rate, prefix_sums, value_rates

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
_INT64_MAX = int(np.iinfo(np.int64).max)


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

    @staticmethod
    def build(shapes: tuple[GraphShape, ...]) -> CatalogIndex:
        def pick(pred: Callable[[GraphShape], bool],
                 key: Callable[[GraphShape], tuple[int, ...] | int]) -> IntArray:
            idx = [i for i, s in enumerate(shapes) if pred(s)]
            idx.sort(key=lambda i: key(shapes[i]))
            return np.array(idx, dtype=np.int64)

        mixed = pick(
            lambda s: s.kind is GraphKind.MIXED
            and s.token_capacity == 1
            and not s.speculation_enabled,
            lambda s: (s.batch_capacity, s.prefill_capacity),
        )
        return CatalogIndex(
            shapes=shapes,
            decode=pick(lambda s: s.kind is GraphKind.DECODE, lambda s: s.batch_capacity),
            prefill=pick(lambda s: s.kind is GraphKind.PREFILL, lambda s: s.token_capacity),
            scored_prefill=pick(
                lambda s: s.kind is GraphKind.SCORED_PREFILL, lambda s: s.token_capacity
            ),
            # Ordinary mixed execution: width one without draft-state maintenance (MIX-44).
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
        )


def _smallest_prompt_per_batch(shapes: tuple[GraphShape, ...], mixed: IntArray) -> IntArray:
    best: dict[int, int] = {}
    for i in mixed.tolist():  # sorted by (B, C): the first of each B is the smallest C
        best.setdefault(shapes[i].batch_capacity, i)
    return np.array(sorted(best.values()), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class ShapeTimes:
    """Per-shape timing state, aligned with ``CatalogIndex.shapes`` (0 / -1 = never)."""

    estimate_ns: IntArray
    last_valid_ns: IntArray
    last_touched_ns: IntArray

    def stale(self, now_ns: int, ttl_ns: int) -> BoolArray:
        """Known and ``now - last valid >= ttl`` (DUR-10, OPEN-11)."""
        result: BoolArray = (self.estimate_ns > 0) & (self.last_valid_ns >= 0) & (
            now_ns - self.last_valid_ns >= ttl_ns)
        return result


@dataclass(frozen=True, slots=True)
class LaneGroup:
    """Requests of one role sorted by descending base value (ties: least recently
    served first). A cohort of size m is the first m; values are prefix sums."""

    records: tuple[RequestRecord, ...]
    base: FloatArray
    slope: float
    """Per-lane age slope ``c*sigma`` (scaled); uniform within a group."""
    prefix: FloatArray
    lru_prefix_min: IntArray
    """``lru_prefix_min[m]`` = least last-served time among the first m (m >= 1)."""

    @staticmethod
    def build(records: list[RequestRecord], base: list[float] | FloatArray,
              slope: float) -> LaneGroup:
        values = np.asarray(base, dtype=np.float64)
        if not records:  # common for terminals: skip the sort machinery
            return LaneGroup((), values, slope, np.zeros(1, dtype=np.float64),
                             np.zeros(1, dtype=np.int64))
        served_all = np.fromiter((r.last_served_ns for r in records), dtype=np.int64,
                                 count=len(records))
        handles = np.fromiter((r.handle for r in records), dtype=np.int64,
                              count=len(records))
        order = np.lexsort((handles, served_all, -values))
        recs = tuple(records[i] for i in order.tolist())
        b = values[order]
        served = served_all[order]
        lru = np.zeros(len(recs) + 1, dtype=np.int64)
        if len(recs):
            lru[1:] = np.minimum.accumulate(served)
        return LaneGroup(recs, b, slope, prefix_sums(b), lru)

    def __len__(self) -> int:
        return len(self.records)


@dataclass(frozen=True, slots=True)
class PromptGroup:
    """Requests with prompt work, as arrays (one entry per request)."""

    records: tuple[RequestRecord, ...]
    cursor: IntArray
    logical_remaining: IntArray
    """Tokens up to the logical end (system boundary or prompt end, SEL-40)."""
    endpoint_remaining: IntArray
    """Tokens up to the next message or prompt endpoint (DUR-20)."""
    reaches_prompt_end: BoolArray
    """Whether consuming all ``logical_remaining`` finishes the prompt."""
    token_price: FloatArray
    """Scaled prefill token price ``1 + f/x``."""
    finish_value: FloatArray
    """Scaled value of the first output: output token price + delivery price."""
    scored: BoolArray
    last_served: IntArray


@dataclass(frozen=True, slots=True)
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
    inference (F of the continuation index, PRE-21, PRE-23); unknown stages count 0."""
    continuation_value: tuple[float, ...] = ()
    """A multistage prompt row's value in its first prefill chunk (0 for decoders)."""

    def continuation(self, i: int, first_ms: float) -> tuple[float, float]:
        """``(V, F)`` of row ``i`` for a prerequisite of duration ``first_ms``: a decoder's
        value ages to ``T + F`` with its own slope; a prompt row's is its first chunk."""
        further = self.further_ms[i]
        if self.decoding[i]:
            return self.base[i] + self.slopes[i] * (first_ms + further), further
        return self.continuation_value[i], further


@dataclass(frozen=True, slots=True)
class DecisionContext:
    """Everything one decision needs, already projected and scaled."""

    catalog: CatalogIndex
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


def _dominated_by_smaller(keys: IntArray, batch: IntArray, prompt: IntArray) -> BoolArray:
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
    earlier[0] = _INT64_MAX
    earlier[1:] = running[:-1]
    result[order] = earlier <= shifted
    return result


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
        lru_m = np.where(m2 > 0, dec.lru_prefix_min[m2], _INT64_MAX)
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
    dominated = _dominated_by_smaller(keys.astype(np.int64, copy=False), caps[:, 0], caps[:, 2])
    table.add(dominated=dominated, **merged)


def select(ctx: DecisionContext) -> ScheduledPlan | None:
    """The winning plan of this decision, or None when nothing is runnable."""
    table = _Table.empty()
    cat = ctx.catalog
    _cohort_candidates(table, ctx, cat.decode, ctx.decoders, terminal=False)
    _cohort_candidates(table, ctx, cat.snapshot, ctx.terminals, terminal=True)
    _prefill_candidates(table, ctx, cat.prefill, scored=False)
    _prefill_candidates(table, ctx, cat.scored_prefill, scored=True)
    _mixed_candidates(table, ctx)
    pair = best_prerequisite(ctx)
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
    return _build_plan(ctx, cols, win, reason, rates, base, known, est)


def _restore_plan(ctx: DecisionContext, pair: PrerequisiteChoice) -> ScheduledPlan:
    """The prerequisite plan: only the prerequisite graph executes before replanning
    (PRE-19); its duration is its own (PRE-17). Terminal rows in its spare rows are
    TERMINAL lanes (PRE-4)."""
    shape = ctx.catalog.shapes[pair.shape]
    est = int(ctx.estimate_ns[pair.shape])
    group = ctx.restorable
    role = LaneRole.RESTORE if shape.state_op is StateOp.RESTORE else LaneRole.INITIALIZE
    t_ms = est / NS_PER_MS
    term = ctx.terminals
    lanes = tuple(
        [Lane(handle=group.records[i].handle, epoch=group.records[i].epoch, role=role)
         for i in pair.rows]
        + [Lane(handle=term.records[j].handle, epoch=term.records[j].epoch,
                role=LaneRole.TERMINAL, value=float(term.base[j]) + term.slope * t_ms)
           for j in range(pair.terminals)])
    known = est > 0
    return ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=lanes),
        estimated_duration_ns=est,
        scaled_score=pair.rate if pair.rate is not None else optimistic_rate(pair.value),
        scale_exponent=ctx.exponent,
        duration_known=known,
        stale=bool(ctx.stale[pair.shape]),
        reason=SelectionReason.ORDINARY if known else SelectionReason.DISCOVERY,
        requires_empty_window=True,
        planned_at_ns=ctx.now_ns,
        start_ns=ctx.start_ns,
        useful_value=pair.value,
        lookahead_shape=(None if pair.following_shape is None
                         else ctx.catalog.shapes[pair.following_shape]),
    )


def _build_plan(ctx: DecisionContext, cols: dict[str, npt.NDArray[np.generic]], win: int,
                reason: SelectionReason,
                rates: FloatArray, base: FloatArray, known: BoolArray,
                est: IntArray) -> ScheduledPlan:
    shape_index = int(cols["shape"][win])
    shape = ctx.catalog.shapes[shape_index]
    n_dec = int(cols["n_dec"][win])
    n_term = int(cols["n_term"][win])
    prompt_pos = int(cols["prompt_pos"][win])
    prompt_tokens = int(cols["prompt_tokens"][win])
    t_ms = float(est[win]) / NS_PER_MS
    lanes: list[Lane] = []
    if prompt_pos >= 0:
        p = ctx.prompts
        rec = p.records[prompt_pos]
        final = bool(prompt_tokens == p.logical_remaining[prompt_pos]
                     and p.reaches_prompt_end[prompt_pos])
        value = prompt_tokens * float(p.token_price[prompt_pos]) + (
            float(p.finish_value[prompt_pos]) if final else 0.0)
        lanes.append(Lane(
            handle=rec.handle, epoch=rec.epoch, role=LaneRole.PROMPT,
            prompt_start=rec.prompt_cursor, prompt_tokens=prompt_tokens,
            token_ceiling=1 if final else 0, expected_tokens=1.0 if final else 0.0,
            expected_deliveries=1.0 if final else 0.0, value=value,
        ))
    # Lane values through one array step and ``tolist`` (no numpy scalar per lane);
    # ``base[i] + slope * t_ms`` is the same IEEE operation either way. Lanes are
    # NamedTuples built positionally (fields as in ``types.Lane``).
    dec = ctx.decoders
    if n_dec:
        dec_values = (dec.base[:n_dec] + dec.slope * t_ms).tolist()
        decode = LaneRole.DECODE
        lanes.extend([Lane(rec.handle, rec.epoch, decode, 0, 0, 1, 1.0, 1.0, value)
                      for rec, value in zip(dec.records[:n_dec], dec_values, strict=True)])
    term = ctx.terminals
    if n_term:
        term_values = (term.base[:n_term] + term.slope * t_ms).tolist()
        terminal = LaneRole.TERMINAL
        lanes.extend([Lane(rec.handle, rec.epoch, terminal, 0, 0, 0, 0.0, 0.0, value)
                      for rec, value in zip(term.records[:n_term], term_values, strict=True)])
    mixed = None
    if shape.kind is GraphKind.MIXED:
        mixed = MixedRole(prefill_row=0 if prompt_pos >= 0 else -1,
                          decode_mode=DecodeMode.ORDINARY)
    is_known = bool(known[win])
    stale = bool(ctx.stale[shape_index])
    useful = float(base[win])
    return ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=tuple(lanes), mixed=mixed),
        estimated_duration_ns=int(est[win]),
        scaled_score=float(rates[win]) if is_known else optimistic_rate(useful),
        scale_exponent=ctx.exponent,
        duration_known=is_known,
        stale=stale,
        reason=reason,
        requires_empty_window=(not shape.is_generation) or (not is_known) or stale
        or reason is not SelectionReason.ORDINARY,
        planned_at_ns=ctx.now_ns,
        start_ns=ctx.start_ns,
        useful_value=useful,
    )
