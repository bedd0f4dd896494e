"""The prerequisite lookahead as first written: the executable specification.

``best_prerequisite_reference`` builds the following columns of every MIX-25 case as
fresh arrays (dropping dominated columns) and scores the exact two-stage table for
each prerequisite op, exactly as ``prerequisites.best_prerequisite`` decides it; the
fast version keeps the catalog- and estimate-dependent structure between decisions.
The tests compare the two. Production never calls this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from policy.descriptors import StateOp
from policy.prerequisites import (
    PrerequisiteChoice,
    _fill_spare,
    _multistage_choice,
)
from policy.utility import FloatArray, IntArray, prefix_sums

if TYPE_CHECKING:
    from policy.decision_context import DecisionContext


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


def _following_columns(ctx: DecisionContext, new_dec: int, new_prompts: IntArray
                       ) -> _Following:
    """Every following inference shape in each MIX-25 case (PRE-2, MIX-24)."""
    cat, group = ctx.catalog, ctx.restorable
    cols: list[tuple[IntArray, IntArray, int, int, FloatArray, IntArray]] = []

    def add(shape: IntArray, cap: IntArray, fixed_pre: int, min_new: int,
            extra: FloatArray, prompt: IntArray) -> None:
        if len(shape):
            cols.append((shape, cap, fixed_pre, min_new, extra, prompt))

    zeros = np.zeros
    mixed_b = cat.batch[cat.mixed]
    if new_dec:
        add(cat.decode, cat.batch[cat.decode], 0, 1, zeros(len(cat.decode)),
            np.full(len(cat.decode), -1))
        # MIX-25 prompt absent: a decode-only mixed step does the same work at every
        # prompt capacity of a batch bucket, so only the smallest is not dominated.
        only = cat.mixed_smallest_prompt
        add(only, cat.batch[only], 0, 1, zeros(len(only)), np.full(len(only), -1))
        ready = np.nonzero(~ctx.prompts.scored)[0]
        if len(ready) and len(cat.mixed):
            # MIX-25 prompt already ready: the best ready prompt row per capacity.
            p = ctx.prompts
            caps = cat.capacities[cat.mixed, 2]
            values = _prompt_values(p.token_price[ready], p.finish_value[ready],
                                    p.logical_remaining[ready], caps)
            keep = _undominated(ctx, values, p.logical_remaining[ready], caps)
            add(cat.mixed[keep], (mixed_b - 1)[keep], 0, 1, values.max(axis=0)[keep],
                np.full(int(keep.sum()), -1))
    if len(new_prompts):
        # A newly ready prompt row: following prefill, or MIX-25 prompt enabled by the
        # prerequisite (newly ready decoders may join it, k >= 0).
        tp = np.array(group.token_price, dtype=np.float64)[new_prompts]
        fin = np.array(group.finish_value, dtype=np.float64)[new_prompts]
        rem = np.array(group.remaining, dtype=np.int64)[new_prompts]
        for shapes, caps, follow in (
                (cat.prefill, cat.capacities[cat.prefill, 1], np.zeros(len(cat.prefill),
                                                                       dtype=np.int64)),
                (cat.mixed, cat.capacities[cat.mixed, 2], mixed_b - 1)):
            if not len(shapes):
                continue
            values = _prompt_values(tp, fin, rem, caps)
            keep = _undominated(ctx, values, rem, caps, shapes)
            add(shapes[keep], follow[keep], 1, 0, values.max(axis=0)[keep],
                new_prompts[values.argmax(axis=0)][keep])
    if not cols:
        empty_i = np.zeros(0, dtype=np.int64)
        return _Following(empty_i, empty_i, empty_i, empty_i, np.zeros(0), empty_i)
    return _Following(
        shape=np.concatenate([c[0] for c in cols]).astype(np.int64),
        follow_cap=np.concatenate([c[1] for c in cols]).astype(np.int64),
        fixed_pre=np.concatenate([np.full(len(c[0]), c[2]) for c in cols]).astype(np.int64),
        min_new=np.concatenate([np.full(len(c[0]), c[3]) for c in cols]).astype(np.int64),
        extra=np.concatenate([c[4] for c in cols]).astype(np.float64),
        new_prompt=np.concatenate([c[5] for c in cols]).astype(np.int64),
    )


def _pair_choices(ctx: DecisionContext, shapes: list[int], rows: list[int],
                  fol: _Following, new_order: IntArray, terminals_allowed: bool
                  ) -> list[PrerequisiteChoice]:
    """The exact two-stage choice for each prerequisite shape over every following
    column (PRE-7..13, PRE-46, MIX-25), as one (prerequisite x column x k) table of
    sequence values: k newly ready decoders take the k largest values, ready decoders
    fill the following graph's remaining rows and terminal rows the prerequisite's."""
    group = ctx.restorable
    r_idx = np.array(shapes, dtype=np.int64)
    t_ms = (ctx.estimate_ns[r_idx] / 1e6)[:, None, None]
    b_r = ctx.catalog.batch[r_idx][:, None, None]
    dec, term = ctx.decoders, ctx.terminals
    n_term = len(term) if terminals_allowed else 0
    base = np.array(group.base, dtype=np.float64)
    new_prefix = prefix_sums(base[new_order])
    k = np.arange(0, min(len(new_order), int(b_r.max())) + 1)[None, None, :]
    span = t_ms + (ctx.estimate_ns[fol.shape] / 1e6)[None, :, None]
    pre_left = b_r - fol.fixed_pre[None, :, None] - k
    follow_left = fol.follow_cap[None, :, None] - k
    valid = (k >= fol.min_new[None, :, None]) & (pre_left >= 0) & (follow_left >= 0)
    ready = np.clip(np.minimum(follow_left, len(dec)), 0, None)
    term_n = np.clip(np.minimum(pre_left, n_term), 0, None)
    # A stage-1 terminal stops ageing at T and saves its waiting cost over the rest of
    # the sequence (PRE-13, PRE-46); folded into its value so the rate stays additive.
    saved = ctx.terminal_coefficient * (span * span - t_ms * t_ms) / 2.0
    value = (new_prefix[k] + k * group.slope * span + dec.prefix[ready]
             + ready * dec.slope * span + term.prefix[term_n]
             + term_n * (term.slope * t_ms + saved) + fol.extra[None, :, None])
    known = t_ms > 0
    # Known rows have span >= T > 0; unknown ones rank by value (no division by zero).
    safe_span = np.where(known, span, 1.0)
    score = np.where(known, value / safe_span - safe_span / 2.0 * ctx.waiting, value)
    score = np.where(valid, score, -np.inf).reshape(len(shapes), -1)
    rows_adv = np.where(valid, k + ready + term_n + fol.fixed_pre[None, :, None],
                        -1).reshape(len(shapes), -1)
    best = score.max(axis=1)
    flat_best = np.argmax(np.where(score == best[:, None], rows_adv, -2), axis=1)
    width = value.shape[2]
    picked_value = value.reshape(len(shapes), -1)[np.arange(len(shapes)), flat_best].tolist()
    picked_term = term_n.reshape(len(shapes), -1)[np.arange(len(shapes)), flat_best].tolist()
    known_r = known.ravel().tolist()
    caps_r = b_r.ravel().tolist()
    new_list = new_order.tolist()
    out: list[PrerequisiteChoice] = []
    for i, (r, top, flat) in enumerate(zip(shapes, best.tolist(), flat_best.tolist(),
                                           strict=True)):
        if top == -np.inf:
            continue
        col, kk = divmod(flat, width)
        chosen: list[int] = []
        if fol.new_prompt[col] >= 0:
            chosen.append(int(fol.new_prompt[col]))
        chosen += new_list[:kk]
        t_n = int(picked_term[i])
        out.append(PrerequisiteChoice(
            shape=r, following_shape=int(fol.shape[col]),
            rows=_fill_spare(chosen, rows, int(caps_r[i]) - t_n), terminals=t_n,
            value=float(picked_value[i]), rate=float(top) if known_r[i] else None,
            basis="pair"))
    return out


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


def best_prerequisite_reference(ctx: DecisionContext) -> PrerequisiteChoice | None:
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
    base = np.array(group.base, dtype=np.float64)
    for op, shapes in ((StateOp.RESTORE, ctx.catalog.restore),
                       (StateOp.INITIALIZE, ctx.catalog.initialize)):
        rows = [i for i, o in enumerate(group.next_op) if o is op]
        if not rows or not len(shapes):
            continue
        single = [i for i in rows if not group.multistage[i]]
        multi = [i for i in rows if group.multistage[i]]
        new_dec = np.array([i for i in single if group.decoding[i]], dtype=np.int64)
        new_order = new_dec[np.argsort(-base[new_dec], kind="stable")]
        new_prompts = np.array([i for i in single if not group.decoding[i]], dtype=np.int64)
        fol = _following_columns(ctx, len(new_order), new_prompts)
        terminals_allowed = op is StateOp.RESTORE
        options: list[PrerequisiteChoice | None] = []
        if len(fol.shape):
            options += _pair_choices(ctx, shapes.tolist(), rows, fol, new_order,
                                     terminals_allowed)
        for r in shapes.tolist():
            options.append(_multistage_choice(ctx, r, rows, multi, terminals_allowed))
            if len(fol.shape) and terminals_allowed and len(ctx.terminals):
                first = int(new_order[0]) if len(new_order) else int(new_prompts[0])
                options.append(_prefix_choice(ctx, r, rows, first))
        for option in options:
                if option is not None and (best is None or option.key() < best.key()):
                    best = option
    return best
