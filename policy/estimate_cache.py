"""``EstimateCache``: what a scheduler derives from its duration estimates, kept warm.

Every decision reads each loaded shape's estimate, last valid observation and last
touch as arrays (``ShapeTimes``), and every admission and commit reads the fair-share
normalizers of a population (``policy.service.normalizers_from_catalog``). Both depend
only on the estimates, so this module builds them once and keeps them until an
estimate changes: an observation or attempt updates one shape's entries in place, and
a caller that may have changed the estimates directly drops everything
(``invalidate``). With a shared speed factor (``policy.cost_drift``) every sample moves
every estimate; the cache then keeps each shape's own base and rescales the whole
array from it, which looks no shape up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from policy.catalog_index import CatalogIndex, ShapeTimes
from policy.cost_drift import DriftingEstimates
from policy.descriptors import GraphKind, GraphShape
from policy.duration_estimates import DurationEstimates
from policy.service import Normalizers, normalizers_from_catalog

__all__ = ["EstimateCache", "fair_share_population"]


def fair_share_population(catalog: CatalogIndex) -> int:
    """How many requests a new request's fair-share start is divided among: the
    catalog's request slots (its largest generation batch), not the momentary
    resident count. Requests admitted together then start at the same price, so
    their order is decided by service, not by who arrived first in a burst (a
    resident-count population made a burst of arrivals run last-in first-out)."""
    slots = [s.batch_capacity for s in catalog.shapes if s.is_generation
             or s.kind is GraphKind.MIXED]
    return max(slots, default=1)


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value


class EstimateCache:
    """Per-shape timing arrays and fair-share normalizers over one ``DurationEstimates``."""

    def __init__(self, estimates: DurationEstimates) -> None:
        self.estimates = estimates
        self._times: ShapeTimes | None = None
        self._shapes: tuple[GraphShape, ...] = ()
        """The catalog the arrays are aligned with."""
        self._log_bases: list[float | None] = []
        """Each catalog shape's own log cost, with a shared speed factor."""
        self._normalizers: dict[int, Normalizers] = {}

    def invalidate(self) -> None:
        """Drop every derived value (the estimates or the catalog may have changed)."""
        self._times = None
        self._normalizers.clear()

    def shape_times(self, catalog: CatalogIndex) -> ShapeTimes:
        """Per-shape estimate arrays in ``catalog`` order, rebuilt only after
        ``invalidate``."""
        if self._times is None:
            est = self.estimates
            shapes = catalog.shapes
            self._times = ShapeTimes(
                estimate_ns=np.array([est.estimate_ns(s) for s in shapes], dtype=np.int64),
                last_valid_ns=np.array([_or_minus_one(est.last_valid_ns(s)) for s in shapes],
                                       dtype=np.int64),
                last_touched_ns=np.array([est.last_touched_ns(s) for s in shapes],
                                         dtype=np.int64),
            )
            self._shapes = shapes
            if isinstance(est, DriftingEstimates):
                self._log_bases = [est.log_base(s) for s in shapes]
        return self._times

    def refresh_shape(self, catalog: CatalogIndex, shape: GraphShape) -> None:
        """Update one shape's cached timing entries in place."""
        times = self._times
        i = catalog.position.get(shape)
        if times is None or i is None:
            return
        est = self.estimates
        times.update(i, est.estimate_ns(shape), _or_minus_one(est.last_valid_ns(shape)),
                     est.last_touched_ns(shape))

    def normalizers(self, population: int) -> Normalizers:
        cached = self._normalizers.get(population)
        if cached is None:
            cached = normalizers_from_catalog(self._known_estimates(), population)
            self._normalizers[population] = cached
        return cached

    def _known_estimates(self) -> Mapping[GraphShape, int] | Iterable[tuple[GraphShape, int]]:
        """Every known estimate: with a shared speed factor, read from the rescaled
        arrays when the catalog holds every measured shape (no estimate recomputed)."""
        est, times = self.estimates, self._times
        if (isinstance(est, DriftingEstimates) and times is not None
                and est.measured_count() == np.count_nonzero(times.estimate_ns > 0)):
            return zip(self._shapes, times.estimate_ns.tolist(), strict=True)
        return est.measured()

    def record_attempt(self, catalog: CatalogIndex, shape: GraphShape, now_ns: int) -> None:
        """``shape`` was committed at ``now_ns`` (its last touch)."""
        self.estimates.record_attempt(shape, now_ns)
        self.refresh_shape(catalog, shape)

    def observe(self, catalog: CatalogIndex, shape: GraphShape, sample_ns: int,
                now_ns: int) -> None:
        """A completed frame's cost sample for ``shape``."""
        est = self.estimates
        if isinstance(est, DriftingEstimates):  # one sample moves every estimate
            est.observe(shape, sample_ns, now_ns)
            self._normalizers.clear()
            times, i = self._times, catalog.position.get(shape)
            if times is not None:
                if i is not None:
                    self._log_bases[i] = est.log_base(shape)
                    self.refresh_shape(catalog, shape)
                times.set_estimates(est.estimates_at_speed(self._log_bases))
            return
        before = est.estimate_ns(shape)
        if est.observe(shape, sample_ns, now_ns) and est.estimate_ns(shape) != before:
            # Normalizers depend on estimate values only: an unchanged median keeps them.
            self._normalizers.clear()
        self.refresh_shape(catalog, shape)
