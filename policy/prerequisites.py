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

import numpy as np

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
    decoders. Decoders' age terms run to the following graph's completion (PRE-12), so
    every decoder value is ``base + slope*(T+F)`` with one slope: the sorted orders do not
    depend on the pair, and the k-enumeration of ``best_pair_cohort`` becomes a vector
    expression over prefix sums. The restore graph also advances further restorable rows
    in its spare capacity at no extra cost (PRE-15). An unknown following duration
    counts as zero (optimistic, PRE-24); an unknown restore duration ranks by useful
    value (DUR-22/23, PRE-50).
    """
    group = ctx.restorable
    n = len(group.records)
    if n == 0 or len(ctx.catalog.restore) == 0:
        return None
    decoding = np.array(group.decoding, dtype=np.bool_)
    base = np.array(group.base, dtype=np.float64)
    dec_rows = np.nonzero(decoding)[0]
    dec_rows = dec_rows[np.argsort(-base[dec_rows], kind="stable")]
    new_prefix = prefix_sums(base[dec_rows])
    ready_prefix = ctx.decoders.prefix
    slope = group.slope
    prompt_rows = np.nonzero(~decoding)[0]
    token_price = np.array(group.token_price, dtype=np.float64)[prompt_rows]
    finish = np.array(group.finish_value, dtype=np.float64)[prompt_rows]
    remaining = np.array(group.remaining, dtype=np.int64)[prompt_rows]
    est_ms = ctx.estimate_ns / 1e6
    # Following prefill shapes: one newly ready prompt row each (k = 1), the same for
    # every restore shape, so evaluate them once as a matrix.
    prefill_idx = ctx.catalog.prefill
    prefill_values = np.zeros((len(prompt_rows), len(prefill_idx)))
    if len(prompt_rows) and len(prefill_idx):
        cap = ctx.catalog.capacities[prefill_idx, 1][None, :]
        rem = remaining[:, None]
        prefill_values = token_price[:, None] * np.minimum(cap, rem) + np.where(
            cap >= rem, finish[:, None], 0.0)
    best: tuple[tuple[int, float, int], int, int, float, float | None] | None = None
    for r in ctx.catalog.restore.tolist():
        t_ms = float(est_ms[r])
        b_r = int(ctx.catalog.batch[r])
        options: list[tuple[int, float]] = []
        if len(dec_rows):
            for s in ctx.catalog.decode.tolist():
                b_s = int(ctx.catalog.batch[s])
                k = np.arange(1, min(b_r, b_s, len(dec_rows)) + 1)
                ready = np.minimum(b_s - k, len(ctx.decoders))
                span = t_ms + float(est_ms[s])
                values = new_prefix[k] + ready_prefix[ready] + (k + ready) * slope * span
                options.append((s, float(values.max())))
        if len(prompt_rows):
            options += zip(prefill_idx.tolist(), prefill_values.max(axis=0).tolist(),
                           strict=True)
        for s, value in options:
            rate = None
            if t_ms > 0:
                rate = sequence_rate(value=value, first_ms=t_ms, following_ms=float(est_ms[s]),
                                     waiting=ctx.waiting)
            key = (0 if rate is None else 1, -(value if rate is None else rate), -min(b_r, n))
            if best is None or key < best[0]:
                best = (key, r, s, value, rate)
    if best is None:
        return None
    _, r, s, value, rate = best
    if s in ctx.catalog.decode.tolist():
        served_first = dec_rows.tolist()
    else:
        column = int(np.nonzero(prefill_idx == s)[0][0])
        served_first = prompt_rows[np.argsort(-prefill_values[:, column],
                                              kind="stable")].tolist()
    # Advance the served rows first, then spare capacity (PRE-15).
    taken = set(served_first)
    ranked = [*served_first, *(i for i in range(n) if i not in taken)]
    rows_advanced = min(int(ctx.catalog.batch[r]), n)
    return RestoreChoice(r, s, tuple(ranked[:rows_advanced]), value, rate)
