"""The exact two-stage prerequisite lookahead as a table (seed: *Prerequisites and
completion*; MIX-24, MIX-25).

This module owns the (prerequisite shape x following inference column x k newly ready
decoders) table that ``prerequisites.best_prerequisite`` scores for every
prerequisite op: for each fixed pair of shapes the exact best cohort (PRE-7..10) is the
k largest newly ready values, the largest ready decoders in the following graph's
remaining rows and the largest terminal rows in the prerequisite's (PRE-4, PRE-13,
PRE-46), scored over the sequence T + F (PRE-11..13); ties prefer more advanced rows
(PRE-16). The following columns of each MIX-25 case combination form a per-catalog
template; dominated columns (identical logical work at a larger capacity, SEL-32) are
masked per decision. The table is a few hundred cells, so it is walked as Python
floats over lists cached per catalog and per estimate version, with the same IEEE
operations in the same order as the vectorised table in
``prerequisites_reference.py`` (bit-identical choices, compared in the tests).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np

from policy.utility import IntArray

if TYPE_CHECKING:
    from policy.decision_context import DecisionContext

_EMPTY: IntArray = np.zeros(0, dtype=np.int64)


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
