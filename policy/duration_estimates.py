"""Duration estimates: one measured cost per physical program (seed: *Duration estimates*).

This module owns the cost catalog the scheduler ranks candidates with (seed ``cost.rs``).
It never reads a clock: every call that depends on time takes ``now_ns``.

Rules implemented here (DUR-1..19, CAT-8; OPEN-10, OPEN-11 as decided in
``docs/design/requirements.md``):

- The identity of an entry is the whole ``GraphShape``: kind, batch capacity, token
  capacity, proposal depth, mixed prefill capacity, packed capacity (and the shape's
  binding / state operation / speculation flag, which only distinguish further). The
  number of active rows is not part of it (DUR-4, DUR-5, DUR-7, OPEN-27).
- Every estimate starts at zero, which means *unknown* (DUR-2, DUR-3); descriptors carry no
  estimate into this catalog.
- Samples are ``ExecutionTiming.cost_sample_ns``: the maximum positive rank interval less
  the exposed readiness delay (DUR-14, DUR-15). A sample ``<= 0`` (missing or zero
  interval) changes nothing and does not make the entry fresh (DUR-19, REF-10).
- The first positive sample sets the estimate (DUR-8). While fresh, each further valid
  sample joins a window of the last nine and the estimate becomes their median; for an
  even count the middle pair is averaged (DUR-9), rounding down to whole nanoseconds.
- An entry is stale when ``now - last_valid_observation >= ttl`` (inclusive boundary,
  OPEN-11, DUR-10). A stale entry keeps its estimate for ranking and normalisation
  (DUR-11, DUR-13, CAT-8: no 7/8 averaging, no reverting to unknown). Its first valid
  sample replaces the estimate and starts a new nine-sample window (DUR-12, OPEN-10).
- ``record_attempt`` marks a committed dispatch (REF-9); ``last_touched_ns`` is the later
  of the last valid observation and the last attempt, the key that orders refresh
  alternatives least recently touched first (REF-8, OPEN-9).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from policy.descriptors import GraphShape

__all__ = ["DEFAULT_ESTIMATE_TTL_NS", "MEDIAN_WINDOW", "DurationEstimates", "median_ns"]

MEDIAN_WINDOW = 9
"""The estimate is the median of the last nine valid samples while fresh (DUR-9)."""

DEFAULT_ESTIMATE_TTL_NS = 30_000_000_000
"""Freshness interval, PolicyConfig.estimate_ttl_ns's default (DUR-10, POL-9)."""


def median_ns(samples: Sequence[int]) -> int:
    """Median of positive samples; an even count averages the middle pair, rounded down."""
    if not samples:
        raise ValueError("median of no samples")
    ordered = sorted(samples)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) // 2


@dataclass(slots=True)
class _Entry:
    estimate_ns: int = 0
    last_valid_ns: int | None = None
    last_attempt_ns: int | None = None
    window: deque[int] = field(default_factory=lambda: deque(maxlen=MEDIAN_WINDOW))


class DurationEstimates:
    """The cost catalog: measured duration per physical program, in nanoseconds."""

    def __init__(self, ttl_ns: int = DEFAULT_ESTIMATE_TTL_NS) -> None:
        self._ttl_ns = _checked_ttl(ttl_ns)
        self._entries: dict[GraphShape, _Entry] = {}

    @property
    def ttl_ns(self) -> int:
        """The freshness interval in force (PolicyConfig.estimate_ttl_ns)."""
        return self._ttl_ns

    @ttl_ns.setter
    def ttl_ns(self, value: int) -> None:
        self._ttl_ns = _checked_ttl(value)

    def estimate_ns(self, shape: GraphShape) -> int:
        """The estimate for ``shape``; 0 means unknown (DUR-2, DUR-3)."""
        entry = self._entries.get(shape)
        return entry.estimate_ns if entry is not None else 0

    def is_known(self, shape: GraphShape) -> bool:
        """True once a valid sample has set the estimate; time never undoes it (DUR-13)."""
        return self.estimate_ns(shape) > 0

    def is_stale(self, shape: GraphShape, now_ns: int) -> bool:
        """Known and ``now - last valid observation >= ttl`` (DUR-10, OPEN-11).

        Unknown shapes are not stale: they are unknown, a separate class (DUR-22).
        """
        entry = self._entries.get(shape)
        if entry is None or entry.last_valid_ns is None:
            return False
        return now_ns - entry.last_valid_ns >= self._ttl_ns

    def is_fresh(self, shape: GraphShape, now_ns: int) -> bool:
        """Known and not stale: the only class that may be queued behind other work."""
        return self.is_known(shape) and not self.is_stale(shape, now_ns)

    def observe(self, shape: GraphShape, sample_ns: int, now_ns: int) -> bool:
        """Apply one cost sample (``ExecutionTiming.cost_sample_ns``) taken at ``now_ns``.

        Returns True when the sample was applied; a sample ``<= 0`` changes nothing and
        leaves freshness untouched (DUR-19). The first valid sample of an unknown or stale
        entry sets the estimate and restarts the window (DUR-8, DUR-12, OPEN-10); a fresh
        entry takes the median of its last nine samples (DUR-9).
        """
        if sample_ns <= 0:
            return False
        entry = self._entries.get(shape)
        if entry is None:
            entry = self._entries[shape] = _Entry()
        if entry.estimate_ns <= 0 or self.is_stale(shape, now_ns):
            entry.window.clear()
            entry.window.append(sample_ns)
            entry.estimate_ns = sample_ns
        else:
            entry.window.append(sample_ns)
            entry.estimate_ns = median_ns(list(entry.window))
        entry.last_valid_ns = (
            now_ns if entry.last_valid_ns is None else max(entry.last_valid_ns, now_ns)
        )
        return True

    def record_attempt(self, shape: GraphShape, now_ns: int) -> None:
        """Mark a committed dispatch of ``shape`` (REF-9: attempts advance only on commit)."""
        entry = self._entries.get(shape)
        if entry is None:
            entry = self._entries[shape] = _Entry()
        if entry.last_attempt_ns is None or now_ns > entry.last_attempt_ns:
            entry.last_attempt_ns = now_ns

    def last_touched_ns(self, shape: GraphShape) -> int:
        """The later of the last valid observation and the last attempt; 0 if never (REF-8)."""
        entry = self._entries.get(shape)
        if entry is None:
            return 0
        times = [t for t in (entry.last_valid_ns, entry.last_attempt_ns) if t is not None]
        return max(times) if times else 0

    def last_valid_ns(self, shape: GraphShape) -> int | None:
        """When the last valid sample arrived, or None if never."""
        entry = self._entries.get(shape)
        return entry.last_valid_ns if entry is not None else None

    def observation_age_ns(self, shape: GraphShape, now_ns: int) -> int | None:
        """``now`` minus the last valid observation (for traces, ACC-32); None if unknown."""
        last = self.last_valid_ns(shape)
        return None if last is None else now_ns - last

    def samples(self, shape: GraphShape) -> tuple[int, ...]:
        """The current window of valid samples, oldest first (at most nine)."""
        entry = self._entries.get(shape)
        return tuple(entry.window) if entry is not None else ()

    def shapes(self) -> tuple[GraphShape, ...]:
        """Every shape with an entry (measured or only attempted)."""
        return tuple(self._entries)

    def measured(self) -> dict[GraphShape, int]:
        """Every known estimate, stale ones included (DUR-11: they still normalise)."""
        return {s: e.estimate_ns for s, e in self._entries.items() if e.estimate_ns > 0}


def _checked_ttl(ttl_ns: int) -> int:
    if isinstance(ttl_ns, bool) or not isinstance(ttl_ns, int) or ttl_ns <= 0:
        raise ValueError(f"estimate ttl must be a positive int of ns, got {ttl_ns!r}")
    return ttl_ns
