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
  continuation index for rows with further stages (PRE-21..25). The pair table itself
  lives in ``prerequisite_pairs.py``; the vectorised version it replaced is kept as
  ``prerequisites_reference.py``.

The returned plan keeps only the prerequisite's own duration (PRE-17); lookahead time
never reaches cost learning (PRE-18). All values here are in the decision's scaled units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy.descriptors import StateOp
from policy.prerequisite_pairs import (
    MEMO_LIMIT,
    FollowingTemplate,
    PairLists,
    PrerequisiteChoice,
    _fill_spare,
    _pair_choices,
    _remember,
    _template,
)
from policy.utility import IntArray, prefix_sums

if TYPE_CHECKING:
    from policy.decision_context import DecisionContext

__all__ = [
    "MEMO_LIMIT",
    "FollowingTemplate",
    "IntArray",
    "PairChoice",
    "PairLists",
    "PrerequisiteChoice",
    "_fill_spare",
    "_remember",
    "best_pair_cohort",
    "best_prerequisite",
    "continuation_index",
    "multistage_rate",
    "sequence_rate",
    "terminal_lane_value",
]


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
