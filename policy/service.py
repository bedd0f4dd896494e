"""Per-request service history, service prices and catalog normalizers.

Seed sections: *Useful service and selection* (the price gradients, SEL-5..10) and
*Service accounting and publication* (ACCT-8..11, ACCT-13..15, ACCT-19..21); seed module
``service.rs``. The exact definitions are in ``docs/scheduling-utility.md`` (OPEN-1); this
module implements exactly that page:

- a request's token rate x and delivery rate z are physical rates per millisecond
  (ACCT-20), exponentially smoothed with time constant tau = ``adaptation_ms``:
  ``x <- x*exp(-dt/tau) + (tokens/dt)*(1 - exp(-dt/tau))`` over a measured interval of
  dt ms, with ``tokens = 0`` for unselected participants (ACCT-11);
- rates never fall below ``RATE_FLOOR_PER_MS``, which keeps every price finite;
- a new request starts at the fair-share rate the measured catalog allows
  (``normalizers_from_catalog``); its delivery coordinate stays missing until its first
  published burst, which sets it to ``deliveries / dt`` (ACCT-19);
- prices are the seed's gradients (SEL-5..7): prefill ``1 + f/x``, output ``beta + f/x``,
  delivery ``g/z``; only actual service changes them (ACCT-21).

Pure: no clocks, no I/O. Intervals come from ``service_interval_ns`` (ACCT-8..10, DUR-16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from policy.config import PolicyConfig
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape

__all__ = [
    "FALLBACK_RATE_PER_MS",
    "RATE_FLOOR_PER_MS",
    "Normalizers",
    "ServiceHistory",
    "delivery_price",
    "new_history",
    "normalizers_from_catalog",
    "observe_delivery",
    "observe_participants",
    "observe_service",
    "output_token_price",
    "prefill_token_price",
    "redo_delivery",
    "service_interval_ns",
    "smoothing_decay",
]

NS_PER_MS = 1_000_000

RATE_FLOOR_PER_MS = 1e-6
"""Lowest token or delivery rate a history holds (one per 1,000 s). With the default
coefficients the largest prices are therefore 1.6e7 (f/x) and 4e6 (g/z): finite, and
representable after selection's per-decision scaling."""

FALLBACK_RATE_PER_MS = 1.0
"""Fair-share rate used while the catalog has no measured shape of the needed kind."""

_TOKEN_KINDS = frozenset({GraphKind.DECODE, GraphKind.PREFILL, GraphKind.SCORED_PREFILL})
_DELIVERY_KINDS = frozenset({GraphKind.DECODE})


@dataclass(frozen=True, slots=True)
class Normalizers:
    """Fair-share rates for one request, from the measured catalog (ACCT-2, OPEN-1)."""

    token_rate_per_ms: float
    """Fair-share token rate the measured catalog allows for one request."""
    delivery_rate_per_ms: float
    """Fair-share delivery rate."""


def normalizers_from_catalog(measured: Mapping[GraphShape, int] | Iterable[tuple[GraphShape, int]],
                             population: int) -> Normalizers:
    """Fair-share rates of one request among ``population`` (docs: *Fair-share start*).

    With ``n = max(population, 1)`` and ``T`` a measured estimate in ms:

    - token: ``max(min(B, n)/T over decode shapes, C/T over prefill shapes) / n``;
    - delivery: ``max(min(B, n)/T over decode shapes) / n``.

    That is the best aggregate rate the catalog achieves for n requests, shared equally.
    A kind with no measured shape falls back to ``FALLBACK_RATE_PER_MS``; results are
    floored at ``RATE_FLOOR_PER_MS``. Stale estimates count (DUR-11). ``measured``: the
    known estimates by shape, or (shape, estimate) pairs where 0 means unknown.
    """
    n = max(population, 1)
    best_tokens = 0.0
    best_deliveries = 0.0
    pairs = measured.items() if isinstance(measured, Mapping) else measured
    for shape, estimate_ns in pairs:
        if estimate_ns <= 0:
            continue
        t_ms = estimate_ns / NS_PER_MS
        if shape.kind in _TOKEN_KINDS:
            if shape.kind is GraphKind.DECODE:
                tokens = min(shape.batch_capacity, n)
            else:
                tokens = shape.token_capacity
            best_tokens = max(best_tokens, tokens / t_ms)
        if shape.kind in _DELIVERY_KINDS:
            best_deliveries = max(best_deliveries, min(shape.batch_capacity, n) / t_ms)
    token_rate = best_tokens / n if best_tokens > 0 else FALLBACK_RATE_PER_MS
    delivery_rate = best_deliveries / n if best_deliveries > 0 else FALLBACK_RATE_PER_MS
    return Normalizers(
        token_rate_per_ms=max(token_rate, RATE_FLOOR_PER_MS),
        delivery_rate_per_ms=max(delivery_rate, RATE_FLOOR_PER_MS),
    )


@dataclass(slots=True)
class ServiceHistory:
    """One request's smoothed service rates, in physical units per ms (ACCT-20)."""

    token_rate: float
    """x: committed tokens per ms, at least ``RATE_FLOOR_PER_MS``."""
    delivery_rate: float | None
    """z: visible bursts per ms; None until the first published burst (ACCT-19)."""
    fair_delivery_rate: float = FALLBACK_RATE_PER_MS
    """The fair-share delivery rate at admission; prices a missing z (docs)."""

    def copy(self) -> ServiceHistory:
        """An independent copy (for projections and the publication correction)."""
        return ServiceHistory(self.token_rate, self.delivery_rate, self.fair_delivery_rate)


def new_history(normalizers: Normalizers) -> ServiceHistory:
    """A new request's history: the fair-share token rate, no delivery coordinate yet."""
    return ServiceHistory(
        token_rate=max(normalizers.token_rate_per_ms, RATE_FLOOR_PER_MS),
        delivery_rate=None,
        fair_delivery_rate=max(normalizers.delivery_rate_per_ms, RATE_FLOOR_PER_MS),
    )


def smoothing_decay(interval_ms: float, config: PolicyConfig) -> float:
    """``exp(-dt/tau)``: the weight the old rate keeps over ``dt`` ms."""
    return math.exp(-interval_ms / config.adaptation_ms)


def _smoothed(rate: float, count: int, interval_ms: float, config: PolicyConfig) -> float:
    decay = smoothing_decay(interval_ms, config)
    return max(rate * decay + (count / interval_ms) * (1.0 - decay), RATE_FLOOR_PER_MS)


def _valid_interval(interval_ms: float) -> bool:
    return math.isfinite(interval_ms) and interval_ms > 0


def observe_service(
    h: ServiceHistory, *, tokens: int, interval_ms: float, config: PolicyConfig
) -> None:
    """Fold ``tokens`` committed over ``interval_ms`` into the token rate (SEL-10, ACCT-8).

    ``tokens = 0`` for unselected participants (ACCT-11). A non-positive or non-finite
    interval contributes nothing (ACCT-8: only frames with a positive interval count).
    """
    if tokens < 0:
        raise ValueError(f"service tokens must be non-negative, got {tokens}")
    if not _valid_interval(interval_ms):
        return
    h.token_rate = _smoothed(h.token_rate, tokens, interval_ms, config)


def observe_delivery(
    h: ServiceHistory, *, deliveries: int, interval_ms: float, config: PolicyConfig
) -> None:
    """Fold ``deliveries`` over ``interval_ms`` into the delivery rate.

    A missing delivery history stays missing under zero deliveries and is initialised to
    ``deliveries / interval_ms`` by the first positive one (ACCT-19).
    """
    if deliveries < 0:
        raise ValueError(f"deliveries must be non-negative, got {deliveries}")
    if not _valid_interval(interval_ms):
        return
    if h.delivery_rate is None:
        if deliveries > 0:
            h.delivery_rate = max(deliveries / interval_ms, RATE_FLOOR_PER_MS)
        return
    h.delivery_rate = _smoothed(h.delivery_rate, deliveries, interval_ms, config)


def observe_participants(served: Sequence[tuple[ServiceHistory, int]], *,
                         interval_ms: float, config: PolicyConfig) -> None:
    """``observe_service(h, tokens)`` then ``observe_delivery(h, 0)`` for every
    ``(history, tokens)`` of one completed frame's participants (ACCT-8..13): the same
    arithmetic with the interval's decay computed once."""
    if not _valid_interval(interval_ms):
        return
    decay = smoothing_decay(interval_ms, config)
    gain = 1.0 - decay
    idle = (0 / interval_ms) * gain
    floor = RATE_FLOOR_PER_MS
    for h, tokens in served:
        if tokens < 0:
            raise ValueError(f"service tokens must be non-negative, got {tokens}")
        x = h.token_rate * decay + (tokens / interval_ms) * gain
        h.token_rate = x if x > floor else floor
        z = h.delivery_rate
        if z is not None:  # a missing delivery history stays missing (ACCT-19)
            z = z * decay + idle
            h.delivery_rate = z if z > floor else floor


def redo_delivery(
    h: ServiceHistory,
    *,
    before: float | None,
    deliveries: int,
    interval_ms: float,
    config: PolicyConfig,
) -> None:
    """Replace an interval's delivery update (ACCT-13, ACCT-14).

    ``before`` is the delivery rate saved just before that interval's zero-delivery update
    at completion; the publication of the same fence calls this with ``deliveries=1``.
    Sound because the publication is processed before the next completion (ACCT-17).
    """
    h.delivery_rate = before
    observe_delivery(h, deliveries=deliveries, interval_ms=interval_ms, config=config)


def prefill_token_price(h: ServiceHistory, config: PolicyConfig) -> float:
    """``1 + f/x`` (SEL-5)."""
    return 1.0 + config.token_fairness / h.token_rate


def output_token_price(h: ServiceHistory, config: PolicyConfig) -> float:
    """``beta + f/x`` (SEL-6)."""
    return config.output_token_value + config.token_fairness / h.token_rate


def delivery_price(h: ServiceHistory, config: PolicyConfig) -> float:
    """``g/z`` (SEL-7); a missing z is priced at the admission fair-share delivery rate."""
    z = h.delivery_rate if h.delivery_rate is not None else h.fair_delivery_rate
    return config.delivery_fairness / z


def service_interval_ns(timing: ExecutionTiming, *, isolated: bool) -> int:
    """The frame's measured service interval in ns; 0 when it contributes none.

    Queued frames: the maximum positive rank-local device interval (ACCT-9); isolated
    frames: the larger of that and the host wall interval (ACCT-10). A frame without a
    positive device interval contributes none (ACCT-8). Raw, not readiness-corrected
    (DUR-16).
    """
    device = timing.device_ns
    if device <= 0:
        return 0
    return max(device, timing.wall_ns) if isolated else device
