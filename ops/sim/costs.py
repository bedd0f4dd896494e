"""Cost tables for ``flare sim``: how long each prepared shape runs.

A ``CostTable`` maps every shape of the simulated catalog to a mean duration in ns and
draws each execution's duration, optionally with multiplicative noise. Three sources
(the roofline models live in ``ops.sim.roofline``):

* ``SyntheticCosts`` (default): a parametric model ``T = a + b * size`` per program
  kind, where ``size`` is the work the fixed shape always pays for (its capacity,
  since padded rows and tokens cost as much as real ones):

  - prefill / scored prefill, chunk capacity C: ``3.0 ms + 0.02 ms * C``
  - decode, batch B: ``8.0 ms + 0.05 ms * B``
  - mixed, batch B, width W, prompt capacity C: ``decode(B * W) + 0.9 * 0.02 ms * C``,
    plus ``0.8 ms * D`` draft steps for a wider speculative mixed program (``D = W - 1``)
  - speculative, batch B, packed P, proposal depth D: ``8.0 ms + 0.05 ms * P + 0.8 ms * D``
    (the target verifies P rows in one pass; the draft, about a tenth of the target,
    proposes D tokens one sequential step at a time)
  - state operations, rows B: ``1.0 ms + 0.2 ms * B``

  These are the ratios of ``tests/policy/synthetic_catalog.py`` (a mid-size model on one
  accelerator: a 1024-token chunk costs about three small decode steps). Synthetic
  results are labelled as such (VER-36).
* ``load_bench_programs(path, catalog)``: the JSON of ``flare bench programs --json``
  (``results[].shape`` labels with ``median_device_ms``, falling back to
  ``median_wall_ms`` when a backend reports no device interval). Every catalog shape
  must be measured; pass the same catalog flags as the benchmark.

Noise: each duration is the mean times ``exp(sigma * z - sigma**2 / 2)`` with ``z``
standard normal from the simulator's seeded generator, so the mean is preserved.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from policy import admission_order
from policy.descriptors import GraphKind, GraphShape

NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticCosts:
    """Parameters of the synthetic ``a + b * size`` model (milliseconds)."""

    prefill_fixed_ms: float = 3.0
    prefill_per_token_ms: float = 0.02
    decode_fixed_ms: float = 8.0
    decode_per_row_ms: float = 0.05
    mixed_prompt_factor: float = 0.9
    draft_step_ms: float = 0.8
    state_fixed_ms: float = 1.0
    state_per_row_ms: float = 0.2

    def mean_ms(self, shape: GraphShape) -> float:
        k = shape.kind
        if k in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            return self.prefill_fixed_ms + self.prefill_per_token_ms * shape.token_capacity
        if k is GraphKind.DECODE:
            return self.decode_fixed_ms + self.decode_per_row_ms * shape.batch_capacity
        if k is GraphKind.MIXED:
            rows = shape.batch_capacity * shape.token_capacity
            return (self.decode_fixed_ms + self.decode_per_row_ms * rows
                    + self.mixed_prompt_factor * self.prefill_per_token_ms
                    * shape.prefill_capacity + self.draft_step_ms * shape.proposal_depth)
        if k is GraphKind.SPECULATIVE:
            return (self.decode_fixed_ms + self.decode_per_row_ms * shape.max_packed_extent
                    + self.draft_step_ms * shape.proposal_depth)
        return self.state_fixed_ms + self.state_per_row_ms * shape.batch_capacity

    def table(self, catalog: Iterable[GraphShape]) -> CostTable:
        return CostTable({s: round(self.mean_ms(s) * NS_PER_MS) for s in catalog},
                         source="synthetic")


@dataclass(frozen=True, slots=True)
class CostTable:
    """Mean duration per shape (ns) and where the numbers came from."""

    mean_ns: Mapping[GraphShape, int]
    source: str
    synthetic: bool = True
    """A model's figures (linear or roofline), not a measured table (VER-36)."""

    def duration_ns(self, shape: GraphShape, rng: np.random.Generator, noise: float) -> int:
        """One execution's duration: the mean, times mean-one log-normal noise."""
        mean = self.mean_ns[shape]
        if noise <= 0:
            return mean
        factor = math.exp(noise * float(rng.standard_normal()) - noise * noise / 2)
        return max(1, round(mean * factor))

    def plus(self, extra_ns: int) -> CostTable:
        """Every mean lengthened by ``extra_ns`` (host time serialised with each frame)."""
        if extra_ns < 0:
            raise CostTableError(f"extra time must be non-negative, got {extra_ns} ns")
        if extra_ns == 0:
            return self
        return CostTable({s: n + extra_ns for s, n in self.mean_ns.items()},
                         source=f"{self.source} + {extra_ns / NS_PER_MS:g} ms per frame",
                         synthetic=self.synthetic)

    def to_json(self) -> dict[str, object]:
        return {"source": self.source, "synthetic": self.synthetic,
                "mean_ms": {s.label(): n / NS_PER_MS for s, n in self.mean_ns.items()}}


class CostTableError(ValueError):
    """The cost file does not cover the simulated catalog."""


def load_bench_programs(path: pathlib.Path, catalog: Iterable[GraphShape]) -> CostTable:
    """Costs from ``flare bench programs --json`` output, for every shape of ``catalog``."""
    data = json.loads(path.read_text())
    results = data.get("results")
    if not isinstance(results, list):
        raise CostTableError(f"{path}: no 'results' list (not a flare bench programs file)")
    by_label: dict[str, float] = {}
    for row in results:
        ms = float(row.get("median_device_ms") or 0.0) or float(row.get("median_wall_ms") or 0.0)
        if ms > 0:
            by_label[str(row["shape"])] = ms
    shapes = tuple(catalog)
    missing = [s.label() for s in shapes if s.label() not in by_label]
    if missing:
        raise CostTableError(
            f"{path} has no timing for {len(missing)} catalog shapes (first: "
            f"{', '.join(missing[:4])}); pass the catalog flags the benchmark used")
    return CostTable({s: round(by_label[s.label()] * NS_PER_MS) for s in shapes},
                     source=str(path), synthetic=False)


def pure_prefill_ns(prompt_tokens: int, catalog: Iterable[GraphShape],
                    costs: CostTable) -> float:
    """The fastest single-shape prefill of ``prompt_tokens`` alone on ``costs``, over
    the prefill shapes of ``catalog`` (``policy.admission_order.pure_prefill_ns``)."""
    return admission_order.pure_prefill_ns(prompt_tokens, (
        (s.token_capacity, costs.mean_ns[s]) for s in catalog if s.kind is GraphKind.PREFILL))
