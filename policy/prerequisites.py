"""Prerequisite lookahead and terminal retirement values (seed: *Prerequisites and
completion*).

This module owns the arithmetic that values work which only *enables* later useful
work:

- the exact two-stage cohort choice for one fixed (prerequisite, inference) shape pair
  (PRE-2..10): lane values are additive, so for each number k >= 1 of newly ready rows
  served by the following graph the best choice is the k largest newly-ready
  contributions, the largest already-ready contributions in the following graph's
  remaining rows, and the largest terminal-completion contributions in the
  prerequisite's remaining rows. Sorted prefix sums give every k in linear time
  (no subset enumeration, PRE-8);
- the two-stage sequence score over T+F with its waiting cost, and the productive
  first-stage prefix alone (PRE-11..14, PRE-46);
- the multistage continuation index ``V*T/(T+F)`` (PRE-21, PRE-22), which is bounded
  lookahead and claims no optimality (PRE-25);
- a terminal lane's value ``terminal_value + terminal_age_price*sigma*(A+T)`` (PRE-44);
- ``best_prerequisite``: the scheduler's prerequisite candidates: (restore or
  initialization, following decode, prefill or mixed) pairs scored with the exact pair
  cohort above, including terminal rows in a restore graph's spare rows (PRE-4), the
  productive first-stage prefix (PRE-14), the three mixed cases of MIX-25, and the
  continuation index for rows with further stages (PRE-21..25).

The returned plan keeps only the prerequisite's own duration (PRE-17); lookahead time
never reaches cost learning (PRE-18). All values here are in the decision's scaled units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from policy.descriptors import StateOp
from policy.utility import FloatArray, prefix_sums

if TYPE_CHECKING:
    from policy.selection import DecisionContext

IntArray = npt.NDArray[np.int64]
_EMPTY: IntArray = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class PairChoice:
    """The best cohort for one fixed shape pair.

    ``newly_ready``/``ready``/``terminal``: how many of the largest contributions of
    each kind are taken; ``value``: their total.
    """

    newly_ready: int
    ready: int
    terminal: int
    value: float


def best_pair_cohort(
    *,
    prerequisite_capacity: int,
    following_capacity: int,
    newly_ready: Sequence[float],
    ready: Sequence[float],
    terminal: Sequence[float],
) -> PairChoice | None:
    """The exact best cohort for fixed shapes (PRE-7, PRE-9), or None when no newly
    ready row can take part (PRE-10). Ties prefer advancing more rows (PRE-16).

    Each newly ready row occupies one prerequisite row and one following row; ready
    rows occupy following rows; terminal rows occupy prerequisite rows.
    """
    new_p = prefix_sums(sorted(newly_ready, reverse=True))
    ready_p = prefix_sums(sorted(ready, reverse=True))
    term_p = prefix_sums(sorted(terminal, reverse=True))
    k_max = min(len(newly_ready), prerequisite_capacity, following_capacity)
    best: PairChoice | None = None
    for k in range(1, k_max + 1):
        r = min(following_capacity - k, len(ready))
        t = min(prerequisite_capacity - k, len(terminal))
        value = float(new_p[k] + ready_p[r] + term_p[t])
        rows = k + r + t
        if best is None or value > best.value or (
            value == best.value and rows > best.newly_ready + best.ready + best.terminal
        ):
            best = PairChoice(k, r, t, value)
    return best


def sequence_rate(*, value: float, first_ms: float, following_ms: float,
                  waiting: float, first_stage_waiting: float = 0.0) -> float:
    """Score of a two-stage sequence over ``T + F`` (PRE-11).

    ``waiting`` is the sum of c_i of the rows still waiting through the whole sequence;
    ``first_stage_waiting`` that of terminal rows retired at time T, which stop
    accumulating waiting cost there (PRE-13, PRE-46). Values must already carry each
    lane's age terms to its own completion (T for terminals, T+F for served decoders,
    PRE-12).
    """
    total = first_ms + following_ms
    # Rows retired at T accumulate c*T^2/2 of waiting, spread over the whole sequence.
    retired_cost = first_stage_waiting * first_ms * first_ms / 2.0 / total
    return value / total - total / 2.0 * waiting - retired_cost


def continuation_index(value: float, first_ms: float, further_ms: float) -> float:
    """``V*T/(T+F)``: a multistage continuation's cohort-ranking contribution (PRE-21).

    An unknown further duration (``further_ms <= 0``) compares optimistically: the
    whole value counts (PRE-24).
    """
    if further_ms <= 0:
        return value
    return value * first_ms / (first_ms + further_ms)


def multistage_rate(contributions: Sequence[float], first_ms: float, waiting: float) -> float:
    """Sum of continuation contributions divided by T, less the decoder waiting cost
    (PRE-22)."""
    return sum(contributions) / first_ms - first_ms / 2.0 * waiting


def terminal_lane_value(*, terminal_value: float, terminal_age_price: float,
                        sigma_ms: float | None, age_ms: float, duration_ms: float) -> float:
    """``terminal_value + terminal_age_price * sigma * (A + T)`` (PRE-44); with no
    measured snapshot family there is no sigma and no age term (PRE-50)."""
    if sigma_ms is None:
        return terminal_value
    return terminal_value + terminal_age_price * sigma_ms * (age_ms + duration_ms)


@dataclass(frozen=True, slots=True)
class PrerequisiteChoice:
    """The best prerequisite candidate of one decision (PRE-1, PRE-2).

    ``shape``: the prerequisite graph (catalog index); ``following_shape``: the
    inference graph of the scored pair (None for the multistage index or the
    first-stage prefix); ``rows``: positions in ``ctx.restorable`` the prerequisite
    advances (the scored ones first, then spare capacity, PRE-15); ``terminals``: how many
    of the first terminal rows (``ctx.terminals`` order) finish in its spare rows
    (PRE-4); ``value``: scaled useful value; ``rate``: the score when the prerequisite's
    duration is known, else None (ranked by useful value, PRE-24, DUR-22);
    ``basis``: "pair", "prefix" (PRE-14) or "multistage" (PRE-21..25).
    """

    shape: int
    following_shape: int | None
    rows: tuple[int, ...]
    terminals: int
    value: float
    rate: float | None
    basis: str

    def key(self) -> tuple[int, float, int]:
        """Ranking key, smaller first: unknown durations first, then by value or
        rate, then more advanced rows (PRE-16)."""
        if self.rate is None:
            return (0, -self.value, -(len(self.rows) + self.terminals))
        return (1, -self.rate, -(len(self.rows) + self.terminals))


@dataclass(frozen=True, slots=True)
class _Following:
    """The following inference columns of one prerequisite op, as arrays.

    Per column: the shape, rows left for newly ready and ready decoders, prerequisite
    rows taken by a fixed prompt row (1 when a newly ready prompt is enabled by the
    prerequisite), the least number of newly ready decoders (PRE-10: 1 unless a newly
    ready prompt already takes part), the fixed prompt row's value and its position
    (in ``ctx.restorable`` when newly ready, -1 otherwise).
    """

    shape: IntArray
    follow_cap: IntArray
    fixed_pre: IntArray
    min_new: IntArray
    extra: FloatArray
    new_prompt: IntArray


def _prompt_values(token_price: FloatArray, finish: FloatArray, remaining: IntArray,
                   caps: IntArray) -> FloatArray:
    """Value of one prompt row (rows) at each prompt capacity (columns): priced tokens
    up to the logical end, plus the first output when the chunk reaches it."""
    rem = remaining[:, None]
    out: FloatArray = token_price[:, None] * np.minimum(caps[None, :], rem) + np.where(
        caps[None, :] >= rem, finish[:, None], 0.0)
    return out


def _undominated(ctx: DecisionContext, values: FloatArray, remaining: IntArray,
                 caps: IntArray, shapes: IntArray | None = None) -> npt.NDArray[np.bool_]:
    """Columns (sorted by batch, then capacity) whose best prompt row does different
    work from the previous column of the same batch bucket; a repeat is a larger
    capacity doing identical logical work and is dominated (SEL-32)."""
    idx = ctx.catalog.mixed if shapes is None else shapes
    best = values.argmax(axis=0)
    tokens = np.minimum(caps, remaining[best])
    batch = ctx.catalog.batch[idx]
    keep = np.ones(len(idx), dtype=np.bool_)
    keep[1:] = ~((batch[1:] == batch[:-1]) & (best[1:] == best[:-1])
                 & (tokens[1:] == tokens[:-1]))
    return keep


class FollowingTemplate(NamedTuple):
    """Every following inference column one prerequisite op can pair with, for one
    combination of MIX-25 cases (catalog constants, ``CatalogIndex.following_memo``).

    Columns, in order: decode shapes, decode-only mixed steps (each batch bucket's
    smallest prompt capacity) and mixed steps with a ready prompt row (when newly ready
    decoders exist); prefill and mixed shapes for a newly ready prompt row. A dominated
    column (identical logical work at a larger capacity, SEL-32) is masked per
    decision, not removed, which leaves the order of the others, and so every choice,
    unchanged."""

    shape: IntArray
    follow_cap: IntArray
    fixed_pre: IntArray
    min_new: IntArray
    ready: slice | None
    """The mixed columns with a ready prompt row."""
    new: slice | None
    """The prefill then mixed columns of a newly ready prompt row."""
    new_split: int
    """Where the mixed part starts inside ``new``."""
    new_caps: IntArray
    new_batch: IntArray


def _template(ctx: DecisionContext, new_dec: bool, ready: bool, new_prompt: bool
              ) -> FollowingTemplate:
    key = (new_dec, ready, new_prompt)
    cat = ctx.catalog
    cached = cat.following_memo.get(key)
    if cached is not None:
        return cached
    parts: list[tuple[IntArray, IntArray, int, int]] = []
    mixed_b = cat.batch[cat.mixed]
    ready_part = new_part = None
    start = 0
    if new_dec:
        only = cat.mixed_smallest_prompt
        parts += [(cat.decode, cat.batch[cat.decode], 0, 1), (only, cat.batch[only], 0, 1)]
        start = len(cat.decode) + len(only)
        if ready:
            parts.append((cat.mixed, mixed_b - 1, 0, 1))
            ready_part = slice(start, start + len(cat.mixed))
            start += len(cat.mixed)
    new_caps = np.concatenate([cat.capacities[cat.prefill, 1], cat.capacities[cat.mixed, 2]])
    new_batch = np.concatenate([cat.batch[cat.prefill], mixed_b])
    if new_prompt:
        parts += [(cat.prefill, np.zeros(len(cat.prefill), dtype=np.int64), 1, 0),
                  (cat.mixed, mixed_b - 1, 1, 0)]
        new_part = slice(start, start + len(cat.prefill) + len(cat.mixed))
    cached = FollowingTemplate(
        shape=np.concatenate([p[0] for p in parts] or [_EMPTY]).astype(np.int64),
        follow_cap=np.concatenate([p[1] for p in parts] or [_EMPTY]).astype(np.int64),
        fixed_pre=np.concatenate([np.full(len(p[0]), p[2]) for p in parts]
                                 or [np.zeros(0)]).astype(np.int64),
        min_new=np.concatenate([np.full(len(p[0]), p[3]) for p in parts]
                               or [np.zeros(0)]).astype(np.int64),
        ready=ready_part, new=new_part, new_split=len(cat.prefill), new_caps=new_caps,
        new_batch=new_batch)
    cat.following_memo[key] = cached
    return cached


def _keep_runs(best: IntArray, tokens: IntArray, batch: IntArray) -> npt.NDArray[np.bool_]:
    """``_undominated`` from a column's best row and tokens: a column repeating the
    previous column's work in the same batch bucket is dominated (SEL-32)."""
    keep = np.ones(len(batch), dtype=np.bool_)
    keep[1:] = ~((batch[1:] == batch[:-1]) & (best[1:] == best[:-1])
                 & (tokens[1:] == tokens[:-1]))
    return keep


def _single_prompt(ctx: DecisionContext, tpl: FollowingTemplate, remaining: int
                   ) -> tuple[IntArray, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """For one newly ready prompt row with ``remaining`` tokens: the tokens each new
    column consumes, whether it reaches the logical end, and which columns are not
    dominated (they depend on ``remaining`` alone: catalog constants)."""
    key = (remaining, tpl.new_split, len(tpl.new_caps))
    cached = ctx.catalog.single_prompt_memo.get(key)
    if cached is None:
        caps, batch, split = tpl.new_caps, tpl.new_batch, tpl.new_split
        tokens = np.minimum(caps, remaining)
        zero = np.zeros(len(caps), dtype=np.int64)
        keep = np.concatenate([_keep_runs(zero[:split], tokens[:split], batch[:split]),
                               _keep_runs(zero[split:], tokens[split:], batch[split:])])
        cached = (tokens, caps >= remaining, keep)
        ctx.catalog.single_prompt_memo[key] = cached
    return cached


def _following_values(ctx: DecisionContext, tpl: FollowingTemplate, new_prompts: list[int]
                      ) -> tuple[FloatArray, npt.NDArray[np.bool_] | None, IntArray | None]:
    """Per template column: the fixed prompt row's value (0 without one), whether the
    column is not dominated (None: all are kept) and the newly ready prompt row's
    position (None: no column has one) -- the per-decision part of
    ``prerequisites_reference._following_columns``."""
    n = len(tpl.shape)
    extra = np.zeros(n, dtype=np.float64)
    keep: npt.NDArray[np.bool_] | None = None
    new_pos: IntArray | None = None
    cat, group = ctx.catalog, ctx.restorable
    if tpl.ready is not None:
        # MIX-25 prompt already ready: the best ready prompt row per capacity.
        p = ctx.prompts
        ready = p.ordinary_rows
        caps = cat.capacities[cat.mixed, 2]
        rem = p.logical_remaining[ready]
        values = _prompt_values(p.token_price[ready], p.finish_value[ready], rem, caps)
        best = values.argmax(axis=0)
        keep = np.ones(n, dtype=np.bool_)
        keep[tpl.ready] = _keep_runs(best, np.minimum(caps, rem[best]), cat.batch[cat.mixed])
        extra[tpl.ready] = values.max(axis=0)
    if tpl.new is not None:
        # A newly ready prompt row: following prefill, or MIX-25 prompt enabled by the
        # prerequisite (newly ready decoders may join it, k >= 0).
        if keep is None:
            keep = np.ones(n, dtype=np.bool_)
        new_pos = np.full(n, -1, dtype=np.int64)
        if len(new_prompts) == 1:
            i = new_prompts[0]
            tokens, reaches, kept = _single_prompt(ctx, tpl, group.remaining[i])
            extra[tpl.new] = group.token_price[i] * tokens + np.where(
                reaches, group.finish_value[i], 0.0)
            keep[tpl.new] = kept
            new_pos[tpl.new] = i
        else:
            rows = np.array(new_prompts, dtype=np.int64)
            tp = np.array(group.token_price, dtype=np.float64)[rows]
            fin = np.array(group.finish_value, dtype=np.float64)[rows]
            rem = np.array(group.remaining, dtype=np.int64)[rows]
            split, start = tpl.new_split, tpl.new.start
            for lo, hi in ((0, split), (split, len(tpl.new_caps))):
                caps, batch = tpl.new_caps[lo:hi], tpl.new_batch[lo:hi]
                values = _prompt_values(tp, fin, rem, caps)
                best = values.argmax(axis=0)
                part = slice(start + lo, start + hi)
                keep[part] = _keep_runs(best, np.minimum(caps, rem[best]), batch)
                extra[part] = values.max(axis=0)
                new_pos[part] = rows[best]
    return extra, keep, new_pos


class PairLayout(NamedTuple):
    """The estimate- and count-dependent structure of one (prerequisite op, template)
    pair table: everything in ``prerequisites_reference._pair_choices`` that does not
    depend on lane values (cached in ``ShapeTimes.pair_memo`` until an estimate
    changes). Arrays are (prerequisite shape, following column, k newly ready)."""

    t_ms: FloatArray
    span: FloatArray
    safe_span: FloatArray
    half_span: FloatArray
    known: npt.NDArray[np.bool_]
    all_known: bool
    span_gain: FloatArray
    """``span * span - t * t``: a stage-1 terminal's saved waiting, before its factor."""
    k: IntArray
    valid: npt.NDArray[np.bool_]
    ready: IntArray
    term_n: IntArray
    advanced: IntArray
    known_list: list[bool]
    caps_list: list[int]


def _pair_layout(ctx: DecisionContext, shapes: IntArray, tpl: FollowingTemplate,
                 key: tuple[int, ...], n_new: int, n_dec: int, n_term: int) -> PairLayout:
    memo = ctx.times.pair_memo
    cached = memo.get(key)
    if cached is not None:
        return cached
    t_ms = (ctx.estimate_ns[shapes] / 1e6)[:, None, None]
    b_r = ctx.catalog.batch[shapes][:, None, None]
    k = np.arange(0, min(n_new, int(b_r.max())) + 1)[None, None, :]
    span = t_ms + (ctx.estimate_ns[tpl.shape] / 1e6)[None, :, None]
    pre_left = b_r - tpl.fixed_pre[None, :, None] - k
    follow_left = tpl.follow_cap[None, :, None] - k
    valid = (k >= tpl.min_new[None, :, None]) & (pre_left >= 0) & (follow_left >= 0)
    ready = np.clip(np.minimum(follow_left, n_dec), 0, None)
    term_n = np.clip(np.minimum(pre_left, n_term), 0, None)
    known = t_ms > 0
    # Known rows have span >= T > 0; unknown ones rank by value (no division by zero).
    safe_span = np.where(known, span, 1.0)
    full = valid.shape
    cached = PairLayout(
        t_ms=t_ms, span=span, safe_span=safe_span, half_span=safe_span / 2.0, known=known,
        all_known=bool(known.all()), span_gain=span * span - t_ms * t_ms, k=k,
        valid=valid, ready=np.broadcast_to(ready, full), term_n=np.broadcast_to(term_n, full),
        advanced=np.broadcast_to(k + ready + term_n + tpl.fixed_pre[None, :, None], full),
        known_list=known.ravel().tolist(), caps_list=b_r.ravel().tolist())
    memo[key] = cached
    return cached


def _pair_choices(ctx: DecisionContext, shapes: IntArray, op: int, rows: list[int],
                  tpl: FollowingTemplate, new_order: list[int], new_prompts: list[int],
                  terminals_allowed: bool) -> list[PrerequisiteChoice]:
    """The exact two-stage choice for each prerequisite shape over every following
    column (PRE-7..13, PRE-46, MIX-25), as one (prerequisite x column x k) table of
    sequence values: k newly ready decoders take the k largest values, ready decoders
    fill the following graph's remaining rows and terminal rows the prerequisite's.

    The same IEEE operations in the same order as the reference; terms that are zero
    by construction (no newly ready decoder, no ready decoder, no terminal row) are
    left out, which is exact because every term is a non-negative value."""
    group = ctx.restorable
    dec, term = ctx.decoders, ctx.terminals
    n_term = len(term) if terminals_allowed else 0
    n_new, n_dec = len(new_order), len(dec)
    key = (op, tpl.ready is not None, tpl.new is not None, n_new, n_dec, n_term,
           len(tpl.shape))
    lay = _pair_layout(ctx, shapes, tpl, key, n_new, n_dec, n_term)
    extra, keep, new_pos = _following_values(ctx, tpl, new_prompts)
    span = lay.span
    terms: list[FloatArray] = []
    if n_new:
        new_prefix = prefix_sums([group.base[i] for i in new_order])
        terms += [new_prefix[lay.k], lay.k * group.slope * span]
    if n_dec:
        terms += [dec.prefix[lay.ready], lay.ready * dec.slope * span]
    if n_term:
        # A stage-1 terminal stops ageing at T and saves its waiting cost over the rest
        # of the sequence (PRE-13, PRE-46); folded into its value so the rate stays
        # additive.
        saved = ctx.terminal_coefficient * lay.span_gain / 2.0
        terms += [term.prefix[lay.term_n], lay.term_n * (term.slope * lay.t_ms + saved)]
    terms.append(extra[None, :, None])
    value = terms[0]
    for t in terms[1:]:
        value = value + t
    valid = lay.valid if keep is None else lay.valid & keep[None, :, None]
    if lay.all_known:
        score = value / span - lay.half_span * ctx.waiting
    else:
        score = np.where(lay.known, value / lay.safe_span - lay.half_span * ctx.waiting,
                         value)
    n_shapes = len(shapes)
    score = np.where(valid, score, -np.inf).reshape(n_shapes, -1)
    rows_adv = np.where(valid, lay.advanced, -1).reshape(n_shapes, -1)
    best = score.max(axis=1)
    flat_best = np.argmax(np.where(score == best[:, None], rows_adv, -2), axis=1)
    width = valid.shape[2]
    pick = (np.arange(n_shapes), flat_best)
    picked_value = np.broadcast_to(value, valid.shape).reshape(n_shapes, -1)[pick].tolist()
    picked_term = lay.term_n.reshape(n_shapes, -1)[pick].tolist()
    out: list[PrerequisiteChoice] = []
    for i, (r, top, flat) in enumerate(zip(shapes.tolist(), best.tolist(),
                                           flat_best.tolist(), strict=True)):
        if top == -np.inf:
            continue
        col, kk = divmod(flat, width)
        chosen: list[int] = []
        if new_pos is not None and new_pos[col] >= 0:
            chosen.append(int(new_pos[col]))
        chosen += new_order[:kk]
        t_n = int(picked_term[i])
        out.append(PrerequisiteChoice(
            shape=r, following_shape=int(tpl.shape[col]),
            rows=_fill_spare(chosen, rows, int(lay.caps_list[i]) - t_n), terminals=t_n,
            value=float(picked_value[i]), rate=float(top) if lay.known_list[i] else None,
            basis="pair"))
    return out


def _fill_spare(chosen: list[int], rows: list[int], capacity: int) -> tuple[int, ...]:
    """The scored rows, then further rows of the same op in spare capacity (PRE-15)."""
    taken = set(chosen)
    return tuple([*chosen, *(i for i in rows if i not in taken)][:max(capacity, len(chosen))])


def _prefix_choice(ctx: DecisionContext, r: int, rows: list[int], first: int
                   ) -> PrerequisiteChoice | None:
    """The productive first-stage prefix alone (PRE-14): the prerequisite finishing
    terminal rows in its spare capacity, scored over T by what completes at T."""
    t_ms = float(ctx.estimate_ns[r]) / 1e6
    b_r = int(ctx.catalog.batch[r])
    term = ctx.terminals
    t_n = min(b_r - 1, len(term))
    if t_n <= 0:
        return None
    value = float(term.prefix[t_n]) + t_n * term.slope * t_ms
    rate = value / t_ms - t_ms / 2.0 * ctx.waiting if t_ms > 0 else None
    return PrerequisiteChoice(shape=r, following_shape=None,
                              rows=_fill_spare([first], rows, b_r - t_n), terminals=t_n,
                              value=value, rate=rate, basis="prefix")


def _multistage_choice(ctx: DecisionContext, r: int, rows: list[int], multi: list[int],
                       terminals_allowed: bool) -> PrerequisiteChoice | None:
    """Rows with further prerequisite stages, ranked by the continuation index
    ``V*T/(T+F)`` (PRE-21..25); terminal rows in the same graph complete at T and count
    their whole value. Sum / T less the waiting cost (PRE-22). No sequence search."""
    if not multi:
        return None
    group = ctx.restorable
    t_ms = float(ctx.estimate_ns[r]) / 1e6
    b_r = int(ctx.catalog.batch[r])
    contributions: list[tuple[float, int]] = []
    for i in multi:
        value, further = group.continuation(i, t_ms)
        contributions.append((continuation_index(value, t_ms, further)
                              if t_ms > 0 else value, i))
    contributions.sort(key=lambda c: -c[0])
    term = ctx.terminals
    term_values = (term.base + term.slope * t_ms).tolist() if terminals_allowed else []
    merged = sorted([(v, i) for v, i in contributions] + [(v, -1 - j)
                    for j, v in enumerate(term_values)], key=lambda c: -c[0])[:b_r]
    if all(i < 0 for _, i in merged):
        merged = [*merged[:-1], contributions[0]]
    scored = [i for _, i in merged if i >= 0]
    t_n = sum(1 for _, i in merged if i < 0)
    total = sum(v for v, _ in merged)
    rate = multistage_rate([v for v, _ in merged], t_ms, ctx.waiting) if t_ms > 0 else None
    return PrerequisiteChoice(shape=r, following_shape=None,
                              rows=_fill_spare(scored, rows, b_r - t_n), terminals=t_n,
                              value=total, rate=rate, basis="multistage")


def best_prerequisite(ctx: DecisionContext) -> PrerequisiteChoice | None:
    """The best prerequisite candidate over every prerequisite shape (restore and
    initialization graphs), or None without prerequisite-ready rows.

    Single-stage rows (the prerequisite makes them ready) are scored as exact
    two-stage pairs with every following decode, prefill and mixed shape (PRE-2..13,
    MIX-24, MIX-25); the first-stage prefix is scored too (PRE-14); rows with further
    stages use the continuation index (PRE-21..25). Terminal rows finish in a restore
    graph's spare rows (PRE-4; an initialization graph copies no rows, so it carries no
    terminal snapshot). Unknown following durations count as zero (PRE-24).
    """
    group = ctx.restorable
    if not group.records:
        return None
    best: PrerequisiteChoice | None = None
    cat = ctx.catalog
    has_ready = bool(len(ctx.prompts.ordinary_rows)) and bool(len(cat.mixed))
    for op, shapes in ((StateOp.RESTORE, cat.restore), (StateOp.INITIALIZE, cat.initialize)):
        rows = [i for i, o in enumerate(group.next_op) if o is op]
        if not rows or not len(shapes):
            continue
        single = [i for i in rows if not group.multistage[i]]
        multi = [i for i in rows if group.multistage[i]]
        # Newly ready decoders, largest value first (a stable order for ties).
        new_order = sorted((i for i in single if group.decoding[i]),
                           key=lambda i: -group.base[i])
        new_prompts = [i for i in single if not group.decoding[i]]
        tpl = _template(ctx, bool(new_order), has_ready and bool(new_order),
                        bool(new_prompts))
        terminals_allowed = op is StateOp.RESTORE
        options: list[PrerequisiteChoice | None] = []
        if len(tpl.shape):
            options += _pair_choices(ctx, shapes, 0 if terminals_allowed else 1, rows, tpl,
                                     new_order, new_prompts, terminals_allowed)
        for r in shapes.tolist():
            if multi:
                options.append(_multistage_choice(ctx, r, rows, multi, terminals_allowed))
            if len(tpl.shape) and terminals_allowed and len(ctx.terminals):
                first = new_order[0] if new_order else new_prompts[0]
                options.append(_prefix_choice(ctx, r, rows, first))
        for option in options:
            if option is not None and (best is None or option.key() < best.key()):
                best = option
    return best
