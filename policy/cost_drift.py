"""flare's extension of the duration estimates: one speed factor shared by every shape.

Not the seed. The seed keeps one estimate per physical program, the median of its last
nine samples (DUR-8, DUR-9), and re-measures a program only when its estimate is stale
(30 s, DUR-10) and refresh credit pays for it (REF-*). On a GPU a captured program
costs about the same all day, so that is enough. On the CPU backend it is not: the
programs share two cores with the server and whatever else runs, and read only the KV
blocks their frame needs, so the whole catalog's speed drifts by 20-50 % within
seconds. A program the scheduler stopped choosing keeps the cost it had in a slow
moment while the programs it does choose are re-measured fast; once two of those look
cheaper than one of it, it is never chosen again, and so never re-measured. Measured
on the embedded model: 16 decoders served as two alternating halves, 122 frames of
``decode[B=8]`` at 2.9 ms each against a ``decode[B=16]`` kept at 7.0 ms that
actually cost 4-5 ms (``docs/design.md``, *A shared speed factor*).

The model, in logarithms: a sample of shape s is ``log y = b_s + L + noise``, where
``b_s`` is the shape's own cost and L the machine's present speed, common to every
shape. Each valid sample of a fresh, known shape has the residual
``r = log y - b_s - L`` (clamped to +-ln 2, so one stalled frame moves little) and
moves both: ``L += w * r`` and ``b_s += (w / 5) * r``. A speed change seen on the
programs that run therefore moves every estimate, the unchosen ones included, and a
shape's own base follows slowly what the common factor does not explain (a frame's
context, its share of the cores). The first sample of an unknown or stale shape sets
``b_s = log y - L`` (DUR-8, DUR-12); the estimate is ``exp(b_s + L)``. Freshness,
attempts and the raw sample window stay the seed's.

``w`` is ``PolicyConfig.cost_drift_weight``: 0 (every preset) keeps the seed's
``DurationEstimates`` exactly; ``flare run`` sets 0.1 on the cpu backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policy.config import PolicyConfig
from policy.descriptors import GraphShape
from policy.duration_estimates import DEFAULT_ESTIMATE_TTL_NS, DurationEstimates

__all__ = ["BASE_WEIGHT_RATIO", "MAX_RESIDUAL", "DriftingEstimates", "estimates_for",
           "reconfigured"]

BASE_WEIGHT_RATIO = 0.2
"""A shape's own base moves at this fraction of the common factor's weight."""

MAX_RESIDUAL = math.log(2.0)
"""A residual counts at most a factor of two either way."""


class DriftingEstimates(DurationEstimates):
    """Duration estimates that share one speed factor across every shape."""

    def __init__(self, ttl_ns: int = DEFAULT_ESTIMATE_TTL_NS, *, weight: float) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"cost drift weight must be in (0, 1], got {weight!r}")
        super().__init__(ttl_ns)
        self._weight = weight
        self._log_speed = 0.0
        self._log_base: dict[GraphShape, float] = {}

    @property
    def weight(self) -> float:
        """w, the common factor's share of each residual."""
        return self._weight

    @property
    def log_speed(self) -> float:
        """L: the natural log of the present speed factor (0 until drift is seen)."""
        return self._log_speed

    def observe(self, shape: GraphShape, sample_ns: int, now_ns: int) -> bool:
        if sample_ns <= 0:
            return False
        y = math.log(sample_ns)
        base = self._log_base.get(shape)
        if base is None or self.is_stale(shape, now_ns):
            self._log_base[shape] = y - self._log_speed
        else:
            r = min(max(y - base - self._log_speed, -MAX_RESIDUAL), MAX_RESIDUAL)
            self._log_speed += self._weight * r
            self._log_base[shape] = base + BASE_WEIGHT_RATIO * self._weight * r
        return super().observe(shape, sample_ns, now_ns)

    def log_base(self, shape: GraphShape) -> float | None:
        """b_s: the shape's own log cost, None until it is measured."""
        return self._log_base.get(shape)

    def estimate_ns(self, shape: GraphShape) -> int:
        base = self._log_base.get(shape)
        return 0 if base is None else _scaled_ns(base, self._log_speed)

    def estimates_at_speed(self, log_bases: Sequence[float | None]) -> list[int]:
        """The estimates of shapes with these own bases at the present speed, 0 for an
        unmeasured one: ``estimate_ns`` of each, without looking the shapes up (the
        estimate cache rescales a whole catalog after every sample)."""
        speed = self._log_speed
        return [0 if b is None else _scaled_ns(b, speed) for b in log_bases]

    def measured_count(self) -> int:
        """How many shapes are measured (``len(measured())``, without computing them)."""
        return len(self._log_base)

    def measured(self) -> dict[GraphShape, int]:
        speed = self._log_speed
        return {s: _scaled_ns(b, speed) for s, b in self._log_base.items()}


def _scaled_ns(log_base: float, log_speed: float) -> int:
    """``exp(b_s + L)`` in whole ns, at least 1."""
    return max(1, round(math.exp(log_base + log_speed)))


def estimates_for(config: PolicyConfig) -> DurationEstimates:
    """The seed's estimates for weight 0, else estimates sharing a speed factor."""
    if config.cost_drift_weight == 0:
        return DurationEstimates(config.estimate_ttl_ns)
    return DriftingEstimates(config.estimate_ttl_ns, weight=config.cost_drift_weight)


def reconfigured(old: DurationEstimates, config: PolicyConfig) -> DurationEstimates:
    """``old`` with a new freshness interval, or, when the weight changed, estimates of
    the new kind holding ``old``'s samples (``configure_policy`` before admission)."""
    weight = old.weight if isinstance(old, DriftingEstimates) else 0.0
    if weight == config.cost_drift_weight:
        old.ttl_ns = config.estimate_ttl_ns
        return old
    new = estimates_for(config)
    for shape in old.shapes():
        at = old.last_valid_ns(shape)
        for sample in old.samples(shape):
            new.observe(shape, sample, at if at is not None else 0)
        if old.last_touched_ns(shape):
            new.record_attempt(shape, old.last_touched_ns(shape))
    return new
