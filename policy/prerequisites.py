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
- ``best_restore_pair``: the scheduler's (restore, following decode or prefill) pair
  candidates, scored with the exact pair cohort above.

The returned plan keeps only the prerequisite's own duration (PRE-17); lookahead time
never reaches cost learning (PRE-18). All values here are in the decision's scaled units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy.utility import prefix_sums

if TYPE_CHECKING:
    from policy.selection import DecisionContext


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
class RestoreChoice:
    """The best (restore, following inference) pair of one decision (PRE-2).

    ``restore_shape``/``following_shape`` index the catalog; ``rows`` are positions in
    the decision's restore order (the rows the restore graph advances, PRE-15);
    ``value`` is the pair's scaled useful value over the sequence, ``rate`` its
    sequence score when the restore duration is known (PRE-11), else None (PRE-24).
    """

    restore_shape: int
    following_shape: int
    rows: tuple[int, ...]
    value: float
    rate: float | None


def best_restore_pair(ctx: DecisionContext) -> RestoreChoice | None:
    """Score every (restore shape, following decode or prefill shape) pair exactly for
    its fixed capacities (PRE-2..10) and return the best; None without restorable rows.

    Newly ready rows are the restorable requests; already ready rows are the current
    decoders. Decoders' age terms run to the following graph's completion (PRE-12).
    The restore graph also advances further restorable rows in its spare capacity at no
    extra cost (PRE-15). An unknown following duration counts as zero (optimistic,
    PRE-24); an unknown restore duration ranks by useful value (DUR-22/23, PRE-50).
    """
    order = ctx.restorable
    if len(order.records) == 0 or len(ctx.catalog.restore) == 0:
        return None
    est = ctx.estimate_ns
    best: RestoreChoice | None = None
    best_key: tuple[int, float, int] | None = None
    n = len(order.records)
    follow_decode = [int(i) for i in ctx.catalog.decode]
    follow_prefill = [int(i) for i in ctx.catalog.prefill]
    for r in ctx.catalog.restore.tolist():
        t_ms = est[r] / 1e6
        rows = tuple(range(min(int(ctx.catalog.batch[r]), n)))
        for s in follow_decode + follow_prefill:
            f_ms = est[s] / 1e6
            span = t_ms + f_ms
            if s in follow_decode:
                newly = [float(v) + order.slope * span if d else float("-inf")
                         for v, d in zip(order.base, order.decoding, strict=True)]
                ready = (ctx.decoders.base + ctx.decoders.slope * span).tolist()
            else:
                cap = int(ctx.catalog.capacities[s, 1])
                newly = [float(tp) * min(cap, int(rem)) + (float(fv) if cap >= rem else 0.0)
                         if not d else float("-inf")
                         for tp, fv, rem, d in zip(order.token_price, order.finish_value,
                                                   order.remaining, order.decoding,
                                                   strict=True)]
                ready = []
            usable = [v for v in newly if v != float("-inf")]
            choice = best_pair_cohort(prerequisite_capacity=len(rows) or 1,
                                      following_capacity=int(ctx.catalog.batch[s]),
                                      newly_ready=usable, ready=ready, terminal=[])
            if choice is None:
                continue
            rate = None
            if t_ms > 0:
                rate = sequence_rate(value=choice.value, first_ms=t_ms, following_ms=f_ms,
                                     waiting=ctx.waiting)
            key = (0 if rate is None else 1,
                   -(choice.value if rate is None else rate), -len(rows))
            if best_key is None or key < best_key:
                # Advance the served rows first, then spare capacity (PRE-15).
                ranked = sorted(range(n), key=lambda i: -newly[i])
                best_key = key
                best = RestoreChoice(r, s, tuple(ranked[: len(rows)]), choice.value, rate)
    return best
