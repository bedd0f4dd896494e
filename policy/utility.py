"""Value arithmetic for one scheduling decision (seed module ``utility.rs``).

This module owns the F-SEL arithmetic, written once and used by every candidate:

    score(T) = (sum of lane base values + sum of lane age slopes * T) / T
               - T/2 * sum over active decoders and pending terminals of c_i

where a served decoder's lane is ``output price * tokens + delivery price * deliveries
+ c_i*sigma_i*(A_i + T)`` (base = everything at T = 0, slope = ``c_i*sigma_i``), a prompt
lane is ``prefill price * consumed tokens`` (plus one output token and delivery when the
chunk reaches the prompt end), and a terminal lane is
``terminal_value + terminal_age_price*sigma*(A + T)`` (PRE-44).

It also owns the shared scaling factor (SEL-20, OPEN-14): every price and coefficient of
one decision is multiplied by ``2**-e`` before any product is formed, with ``e`` the
binary exponent of the largest of them, so the raw score is exactly
``ldexp(scaled, e)`` and ``selection_log_scale() = e * ln 2``; the reference interval
(SEL-15..17) and the additive top-k cohort rule (SEL-25).

Pure: floats and numpy only; no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from policy.descriptors import GraphShape

NS_PER_MS = 1_000_000

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def scale_exponent(magnitudes: Iterable[float]) -> int:
    """The binary exponent ``e`` with ``max|m| * 2**-e`` in [0.5, 1) (0 when all zero).

    Raises ValueError on a non-finite magnitude: prices are kept finite upstream by the
    rate floor, so a non-finite one is a bug, not a preference.
    """
    largest = 0.0
    for m in magnitudes:
        if not math.isfinite(m):
            raise ValueError(f"non-finite price or coefficient {m!r}")
        largest = max(largest, abs(m))
    if largest == 0.0:
        return 0
    return math.frexp(largest)[1]


def scaled(value: float, exponent: int) -> float:
    """``value * 2**-exponent`` (exact for normal floats)."""
    return math.ldexp(value, -exponent)


def unscaled(value: float, exponent: int) -> float:
    """Invert ``scaled``: the raw value in prompt-value units."""
    return math.ldexp(value, exponent)


def reference_interval_ms(
    measured: Iterable[tuple[GraphShape, int]], streams: int
) -> float | None:
    """``sigma = K * T / min(batch_capacity, K)`` for the measured graph minimising
    ``T / min(batch_capacity, K)`` (SEL-15, SEL-16); ``None`` when there are no streams or
    no measured graph of the family: no interval is invented (PRE-50).

    ``measured`` yields (shape, estimate_ns) for the family's known shapes (stale ones
    included, DUR-11).
    """
    if streams <= 0:
        return None
    best: float | None = None
    for shape, estimate_ns in measured:
        if estimate_ns <= 0:
            continue
        per_stream = (estimate_ns / NS_PER_MS) / min(shape.batch_capacity, streams)
        if best is None or per_stream < best:
            best = per_stream
    return None if best is None else streams * best


def value_rate(base: float, slope: float, duration_ms: float, waiting: float) -> float:
    """F-SEL for one candidate of known duration ``duration_ms`` > 0 (SEL-19)."""
    return (base + slope * duration_ms) / duration_ms - duration_ms / 2.0 * waiting


def value_rates(
    base: FloatArray, slope: FloatArray, duration_ms: FloatArray, waiting: float
) -> FloatArray:
    """Vectorised ``value_rate``; entries with ``duration_ms <= 0`` give 0 (unknown
    durations are ranked by useful value instead, DUR-22/23)."""
    safe = np.where(duration_ms > 0, duration_ms, 1.0)
    rates = (base + slope * safe) / safe - safe / 2.0 * waiting
    return np.where(duration_ms > 0, rates, 0.0)


def prefix_sums(values_descending: Sequence[float] | FloatArray) -> FloatArray:
    """``out[k]`` = sum of the first k values (``out[0] = 0``): the best additive cohort
    of size k once lanes are sorted by value (SEL-25, PRE-8)."""
    arr = np.asarray(values_descending, dtype=np.float64)
    out = np.zeros(arr.shape[0] + 1, dtype=np.float64)
    np.cumsum(arr, out=out[1:])
    return out


def optimistic_rate(useful_value: float) -> float:
    """The work score an unknown-duration plan reports (OPEN-13): its scaled useful
    value per millisecond, as if it took one millisecond. Finite, never a division by
    zero (SEL-23); ranking never uses it (unknowns rank by useful value)."""
    return useful_value
