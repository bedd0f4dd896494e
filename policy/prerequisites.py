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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from policy.descriptors import StateOp
from policy.utility import prefix_sums

if TYPE_CHECKING:
    from policy.decision_context import DecisionContext

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


class PrerequisiteChoice(NamedTuple):
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
    shape_list: list[int]
    follow_cap_list: list[int]
    fixed_pre_list: list[int]
    min_new_list: list[int]
    new_caps_list: list[int]
    new_batch_list: list[int]
    mixed_caps_list: list[int]
    """Each ordinary mixed shape's prompt capacity (the ready-prompt columns)."""
    mixed_batch_list: list[int]


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
    shape = np.concatenate([p[0] for p in parts] or [_EMPTY]).astype(np.int64)
    follow_cap = np.concatenate([p[1] for p in parts] or [_EMPTY]).astype(np.int64)
    fixed_pre = np.concatenate([np.full(len(p[0]), p[2]) for p in parts]
                               or [np.zeros(0)]).astype(np.int64)
    min_new = np.concatenate([np.full(len(p[0]), p[3]) for p in parts]
                             or [np.zeros(0)]).astype(np.int64)
    cached = FollowingTemplate(
        shape=shape, follow_cap=follow_cap, fixed_pre=fixed_pre, min_new=min_new,
        ready=ready_part, new=new_part, new_split=len(cat.prefill),
        shape_list=shape.tolist(), follow_cap_list=follow_cap.tolist(),
        fixed_pre_list=fixed_pre.tolist(), min_new_list=min_new.tolist(),
        new_caps_list=new_caps.tolist(), new_batch_list=new_batch.tolist(),
        mixed_caps_list=cat.capacities[cat.mixed, 2].tolist(),
        mixed_batch_list=mixed_b.tolist())
    cat.following_memo[key] = cached
    return cached


class PairLists(NamedTuple):
    """The estimate-dependent constants of one (prerequisite op, template) table as
    Python lists: per prerequisite shape its duration T (ms), batch capacity and
    whether T is known; per (shape, column) the sequence span T + F, half the span
    used for the waiting cost (1.0 when T is unknown, as the reference) and
    ``span * span - T * T`` (a stage-1 terminal's saved waiting before its factor)."""

    t_ms: list[float]
    caps: list[int]
    known: list[bool]
    span: list[list[float]]
    half: list[list[float]]
    gain: list[list[float]]
    cells: list[list[tuple[float, float, float]]]
    """Per shape, each column's ``(span, half, gain / 2)`` (halving is exact, so
    ``tc * (gain / 2) == tc * gain / 2``)."""


def _pair_lists(ctx: DecisionContext, shapes: IntArray, tpl: FollowingTemplate,
                key: tuple[int, ...]) -> PairLists:
    memo = ctx.times.pair_lists_memo
    cached = memo.get(key)
    if cached is None:
        est = ctx.estimate_ns
        t_ms = [e / 1e6 for e in est[shapes].tolist()]
        f_ms = [e / 1e6 for e in est[tpl.shape].tolist()]
        span = [[t + f for f in f_ms] for t in t_ms]
        half = [[(x if t > 0 else 1.0) / 2.0 for x in row] for t, row in zip(t_ms, span,
                                                                            strict=True)]
        gain = [[x * x - t * t for x in row] for t, row in zip(t_ms, span, strict=True)]
        cells = [list(zip(s_row, h_row, [x / 2.0 for x in g_row], strict=True))
                 for s_row, h_row, g_row in zip(span, half, gain, strict=True)]
        cached = PairLists(t_ms, ctx.catalog.batch[shapes].tolist(), [t > 0 for t in t_ms],
                           span, half, gain, cells)
        memo[key] = cached
    return cached


def _runs(best: list[int], tokens: list[int], batch: list[int]) -> list[bool]:
    """Columns (sorted by batch, then capacity) whose best prompt row does different
    work from the previous column of the same batch bucket; a repeat is a larger
    capacity doing identical logical work and is dominated (SEL-32)."""
    return [j == 0 or not (batch[j] == batch[j - 1] and best[j] == best[j - 1]
                           and tokens[j] == tokens[j - 1]) for j in range(len(batch))]


def _best_rows(caps: list[int], price: Sequence[float], finish: Sequence[float],
               remaining: Sequence[int], rows: list[int]
               ) -> tuple[list[int], list[float], list[int]]:
    """A prompt row's value at each capacity (priced tokens up to the logical end, plus
    the first output when the chunk reaches it), over ``rows``; per capacity the first
    best row, its value and its tokens."""
    per_cap: dict[int, tuple[int, float, int]] = {}  # equal capacities: one search
    for c in set(caps):
        top, at, tokens = -np.inf, -1, 0
        for i in rows:
            r = remaining[i]
            v = price[i] * (c if c < r else r) + (finish[i] if c >= r else 0.0)
            if v > top:
                top, at, tokens = v, i, (c if c < r else r)
        per_cap[c] = (at, top, tokens)
    found = [per_cap[c] for c in caps]
    return [f[0] for f in found], [f[1] for f in found], [f[2] for f in found]


def _following(ctx: DecisionContext, tpl: FollowingTemplate, new_prompts: list[int]
                     ) -> tuple[list[float], list[bool] | None, list[int] | None]:
    """Per template column: the fixed prompt row's value (0 without one), whether the
    column is not dominated (None: all are kept) and the newly ready prompt row's
    position (None: no column has one) -- the per-decision part of
    ``prerequisites_reference._following_columns``."""
    n = len(tpl.shape_list)
    extra = [0.0] * n
    keep: list[bool] | None = None
    new_pos: list[int] | None = None
    group = ctx.restorable
    if tpl.ready is not None:
        # MIX-25 prompt already ready: the best ready prompt row per capacity.
        p = ctx.prompts
        grid = ctx.catalog.mixed_grid
        rows, values, tokens = _best_rows(grid.caps_list, p.price, p.finish, p.remaining,
                                          p.ordinary)
        col_c = grid.col_c_list
        start = tpl.ready.start
        keep = [True] * n
        keep[start:start + len(col_c)] = _runs([rows[c] for c in col_c],
                                               [tokens[c] for c in col_c],
                                               tpl.mixed_batch_list)
        extra[start:start + len(col_c)] = [values[c] for c in col_c]
    if tpl.new is not None:
        # A newly ready prompt row: following prefill, or MIX-25 prompt enabled by the
        # prerequisite (newly ready decoders may join it, k >= 0).
        if keep is None:
            keep = [True] * n
        new_pos = [-1] * n
        start, stop = tpl.new.start, tpl.new.stop
        if len(new_prompts) == 1:
            i = new_prompts[0]
            price, finish = group.token_price[i], group.finish_value[i]
            toks, reaches, kept = _single_prompt(ctx, tpl, group.remaining[i])
            extra[start:stop] = [price * t + (finish if r else 0.0)
                                 for t, r in zip(toks, reaches, strict=True)]
            keep[start:stop] = kept
            new_pos[start:stop] = [i] * (stop - start)
        else:
            split = tpl.new_split
            for lo, hi in ((0, split), (split, len(tpl.new_caps_list))):
                caps = tpl.new_caps_list[lo:hi]
                rows, values, tokens = _best_rows(caps, group.token_price,
                                                  group.finish_value, group.remaining,
                                                  new_prompts)
                keep[start + lo:start + hi] = _runs(rows, tokens, tpl.new_batch_list[lo:hi])
                extra[start + lo:start + hi] = values
                new_pos[start + lo:start + hi] = rows
    return extra, keep, new_pos


MEMO_LIMIT = 4096
"""Entries kept per remaining-token memo; one keyed by request lengths must not grow
with the life of the process."""

_K = TypeVar("_K")
_V = TypeVar("_V")


def _remember(memo: dict[_K, _V], key: _K, value: _V) -> None:
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = value


def _single_prompt_columns(ctx: DecisionContext, tpl: FollowingTemplate, remaining: int
                           ) -> list[tuple[int, int, int, bool]]:
    """The kept columns of one newly ready prompt row with ``remaining`` tokens, as
    ``(column, following rows, tokens, reaches the logical end)`` (catalog constants)."""
    start = tpl.new.start if tpl.new is not None else 0
    key = (remaining, tpl.new_split, len(tpl.shape_list), start)
    cached = ctx.catalog.single_columns_memo.get(key)
    if cached is None:
        tokens, reaches, keep = _single_prompt(ctx, tpl, remaining)
        cached = [(start + j, tpl.follow_cap_list[start + j], tokens[j], reaches[j])
                  for j in range(len(keep)) if keep[j]]
        _remember(ctx.catalog.single_columns_memo, key, cached)
    return cached


def _single_prompt(ctx: DecisionContext, tpl: FollowingTemplate, remaining: int
                   ) -> tuple[list[int], list[bool], list[bool]]:
    """For one newly ready prompt row with ``remaining`` tokens: the tokens each new
    column consumes, whether it reaches the logical end, and which columns are not
    dominated (they depend on ``remaining`` alone: catalog constants)."""
    key = (remaining, tpl.new_split, len(tpl.new_caps_list))
    cached = ctx.catalog.single_prompt_memo.get(key)
    if cached is None:
        caps, batch, split = tpl.new_caps_list, tpl.new_batch_list, tpl.new_split
        tokens = [c if c < remaining else remaining for c in caps]
        zero = [0] * len(caps)
        keep = (_runs(zero[:split], tokens[:split], batch[:split])
                + _runs(zero[split:], tokens[split:], batch[split:]))
        cached = (tokens, [c >= remaining for c in caps], keep)
        _remember(ctx.catalog.single_prompt_memo, key, cached)
    return cached


def _pair_choices(ctx: DecisionContext, shapes: IntArray, op: int, rows: list[int],
                  tpl: FollowingTemplate, new_order: list[int], new_prompts: list[int],
                  terminals_allowed: bool) -> list[PrerequisiteChoice]:
    """The exact two-stage choice for each prerequisite shape over every following
    column (PRE-7..13, PRE-46, MIX-25): k newly ready decoders take the k largest
    values, ready decoders fill the following graph's remaining rows and terminal rows
    the prerequisite's; the sequence value and score of each (column, k) in table order,
    the first maximum winning, ties to more advanced rows (PRE-16). The same IEEE
    operations as the vectorised table in ``prerequisites_reference``, walked as Python
    floats: the table is a few hundred cells and each numpy call costs more."""
    group = ctx.restorable
    dec, term = ctx.decoders, ctx.terminals
    n_term = len(term) if terminals_allowed else 0
    n_dec = len(dec)
    lay = _pair_lists(ctx, shapes, tpl, (op, tpl.ready is not None, tpl.new is not None,
                                         len(tpl.shape_list)))
    gs, ds, ts = group.slope, dec.slope, term.slope
    d_pre, t_pre = dec.prefix_list, term.prefix_list if n_term else [0.0]
    tc, w = ctx.terminal_coefficient, ctx.waiting
    k_top = min(len(new_order), max(lay.caps))
    fixed_pre, follow_cap, min_new = tpl.fixed_pre_list, tpl.follow_cap_list, tpl.min_new_list
    new_pos: list[int] | None
    if k_top == 0 and len(new_prompts) == 1:
        # The common case: one newly ready prompt row and no newly ready decoder, so
        # k = 0 only; every column is the prompt row's (one prerequisite row), the first
        # two terms are exactly zero and a column's ready cohort does not depend on the
        # prerequisite shape. Its kept columns and tokens depend on its remaining
        # tokens alone (``_single_prompt``).
        i = new_prompts[0]
        price, finish = group.token_price[i], group.finish_value[i]
        info = []
        for c, fc, tokens, reaches in _single_prompt_columns(ctx, tpl, group.remaining[i]):
            ready = fc if fc < n_dec else n_dec
            info.append((c, ready, d_pre[ready], ready * ds,
                         price * tokens + (finish if reaches else 0.0)))
        new_pos, cols = None, []
        single = i
    else:
        extra, keep, new_pos = _following(ctx, tpl, new_prompts)
        new_prefix = [0.0, *itertools.accumulate([group.base[i] for i in new_order])]
        cols = list(range(len(extra))) if keep is None else [
            c for c, kept in enumerate(keep) if kept]
        single = -1
        if k_top == 0:  # as above, with several newly ready prompt rows
            info = []
            for c in cols:
                if min_new[c] == 0:
                    fc = follow_cap[c]
                    ready = fc if fc < n_dec else n_dec
                    info.append((c, ready, d_pre[ready], ready * ds, extra[c]))
    out: list[PrerequisiteChoice] = []
    for i, r in enumerate(shapes.tolist()):
        t, b_r, known = lay.t_ms[i], lay.caps[i], lay.known[i]
        span_row, half_row, gain_row = lay.span[i], lay.half[i], lay.gain[i]
        aged_t = ts * t
        top, top_adv = -np.inf, -2
        top_col = top_k = top_tn = 0
        top_value = 0.0
        if k_top == 0:
            cells = lay.cells[i]
            tn = b_r - 1 if b_r - 1 < n_term else n_term  # pre_left = B - 1 >= 0
            tp = t_pre[tn]
            for c, ready, d, rds, ex in info:
                span, half, gain_half = cells[c]
                if tn:
                    value = d + rds * span + tp + tn * (aged_t + tc * gain_half) + ex
                else:  # both terminal terms are +0.0 and the sum is non-negative
                    value = d + rds * span + ex
                score = value / span - half * w if known else value
                if score >= top:
                    adv = ready + tn + 1
                    if score > top or adv > top_adv:
                        top, top_adv, top_col, top_tn, top_value = score, adv, c, tn, value
        for c in cols if k_top else ():
            fixed = fixed_pre[c]
            span = span_row[c]
            saved = tc * gain_row[c] / 2.0
            for k in range(min_new[c], k_top + 1):
                pre_left = b_r - fixed - k
                follow_left = follow_cap[c] - k
                if pre_left < 0 or follow_left < 0:
                    break
                ready = follow_left if follow_left < n_dec else n_dec
                tn = pre_left if pre_left < n_term else n_term
                value = (new_prefix[k] + k * gs * span + d_pre[ready] + ready * ds * span
                         + t_pre[tn] + tn * (aged_t + saved) + extra[c])
                score = value / span - half_row[c] * w if known else value
                adv = k + ready + tn + fixed
                if score > top or (score == top and adv > top_adv):
                    top, top_adv, top_col, top_k, top_tn, top_value = (
                        score, adv, c, k, tn, value)
        if top == -np.inf:
            continue
        chosen: list[int] = []
        if single >= 0:
            chosen.append(single)
        elif new_pos is not None and new_pos[top_col] >= 0:
            chosen.append(new_pos[top_col])
        chosen += new_order[:top_k]
        out.append(PrerequisiteChoice(
            shape=r, following_shape=tpl.shape_list[top_col],
            rows=_fill_spare(chosen, rows, b_r - top_tn), terminals=top_tn,
            value=top_value, rate=top if known else None, basis="pair"))
    return out


def _fill_spare(chosen: list[int], rows: list[int], capacity: int) -> tuple[int, ...]:
    """The scored rows, then further rows of the same op in spare capacity (PRE-15)."""
    taken = set(chosen)
    return tuple([*chosen, *(i for i in rows if i not in taken)][:max(capacity, len(chosen))])


def _prefix_choice(ctx: DecisionContext, r: int, rows: list[int], first: int, t_ms: float,
                   b_r: int) -> PrerequisiteChoice | None:
    """The productive first-stage prefix alone (PRE-14): the prerequisite ``r`` (duration
    ``t_ms``, ``b_r`` rows) finishing terminal rows in its spare capacity, scored over T
    by what completes at T."""
    term = ctx.terminals
    t_n = min(b_r - 1, len(term))
    if t_n <= 0:
        return None
    value = term.prefix_list[t_n] + t_n * term.slope * t_ms
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
    aged = term.slope * t_ms
    term_values = [b + aged for b in term.base_list] if terminals_allowed else []
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
    best_key: tuple[int, float, int] = (0, 0.0, 0)
    cat = ctx.catalog
    has_ready = bool(ctx.prompts.ordinary) and bool(len(cat.mixed))
    for op, shapes in ((StateOp.RESTORE, cat.restore), (StateOp.INITIALIZE, cat.initialize)):
        if not len(shapes):
            continue
        rows = [i for i, o in enumerate(group.next_op) if o is op]
        if not rows:
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
        if len(tpl.shape_list):
            options += _pair_choices(ctx, shapes, 0 if terminals_allowed else 1, rows, tpl,
                                     new_order, new_prompts, terminals_allowed)
        prefix = bool(len(tpl.shape_list)) and terminals_allowed and bool(len(ctx.terminals))
        if multi or prefix:
            est = ctx.estimate_ns
            for r, b_r in zip(shapes.tolist(), cat.batch[shapes].tolist(), strict=True):
                if multi:
                    options.append(_multistage_choice(ctx, r, rows, multi,
                                                      terminals_allowed))
                if prefix:
                    first = new_order[0] if new_order else new_prompts[0]
                    options.append(_prefix_choice(ctx, r, rows, first, int(est[r]) / 1e6,
                                                  b_r))
        for option in options:
            if option is not None:
                key = option.key()
                if best is None or key < best_key:
                    best, best_key = option, key
    return best
