"""The prepared shapes each simulated policy runs on, as ``flare run`` would load them.

A server without speculation prepares the ordinary catalog; one with a draft (``flare
run --draft-model``/``--draft-source copy``, draft depth D) prepares the speculative
load of ``gpu.catalog.build_catalog`` (rectangular ``QueryLength`` programs of widths
1..D+1, width-one mixed programs that keep the draft context). Like
``actors.system.served_shapes`` (which this module mirrors without importing the
runtime), the speculative load drops wider mixed programs (the speculative scheduler
plans no mixed speculative rows), and fixed-width mode (``spec-fixed``) keeps only the
widest speculative program per batch bucket and no ordinary decode (MIX-7, LRN-10).

So a simulated comparison puts each policy on the catalog its real server would have:
non-speculative policies on the ordinary catalog, ``spec-adaptive`` and ``fixed-spec-K``
on the speculative load, ``spec-fixed`` on its fixed-width subset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpu.catalog import CatalogFlags, build_catalog
from policy.baselines import speculative_policy
from policy.descriptors import GraphKind, GraphShape

DEFAULT_DRAFT_DEPTH = 4
"""``flare run``'s default ``--draft-depth``."""


@dataclass(frozen=True, slots=True)
class Catalogs:
    """The ordinary catalog, the speculative load and its fixed-width subset."""

    ordinary: tuple[GraphShape, ...]
    speculative: tuple[GraphShape, ...]
    fixed_width: tuple[GraphShape, ...]

    def for_policy(self, name: str) -> tuple[GraphShape, ...]:
        if name == "spec-fixed":
            return self.fixed_width
        return self.speculative if speculative_policy(name) else self.ordinary

    def union(self, policies: Iterable[str]) -> tuple[GraphShape, ...]:
        """Every shape the named policies may run (what a cost table must cover)."""
        return tuple(dict.fromkeys(s for name in policies for s in self.for_policy(name)))


def build_catalogs(*, max_batch: int, prefill_capacities: Sequence[int], mixed_prefill: bool,
                   draft_depth: int = DEFAULT_DRAFT_DEPTH,
                   speculative_token_capacity: int = 0) -> Catalogs:
    """All three catalogs from ``flare run``'s catalog flags (``CatalogError`` on bad
    flags; ``draft_depth`` 0 leaves the speculative ones empty)."""
    def catalog(depth: int) -> tuple[GraphShape, ...]:
        return build_catalog(CatalogFlags(
            max_batch=max_batch, prefill_capacities=tuple(prefill_capacities),
            mixed_prefill=mixed_prefill, family_supports_mixed=True, draft_depth=depth,
            speculative_token_capacity=speculative_token_capacity)).shapes

    ordinary = catalog(0)
    if draft_depth <= 0:
        return Catalogs(ordinary, (), ())
    load = served_speculative_shapes(catalog(draft_depth))
    return Catalogs(ordinary, load, fixed_width_shapes(load))


def served_speculative_shapes(shapes: Sequence[GraphShape]) -> tuple[GraphShape, ...]:
    """A speculative load less the mixed programs wider than one row per lane."""
    return tuple(s for s in shapes if not (s.kind is GraphKind.MIXED and s.token_capacity > 1))


def fixed_width_shapes(shapes: Sequence[GraphShape]) -> tuple[GraphShape, ...]:
    """Fixed-width mode: the widest speculative program per batch bucket, no decode."""
    widest: dict[int, int] = {}
    for s in shapes:
        if s.kind is GraphKind.SPECULATIVE:
            widest[s.batch_capacity] = max(widest.get(s.batch_capacity, 0), s.token_capacity)
    return tuple(s for s in shapes if s.kind is not GraphKind.DECODE and (
        s.kind is not GraphKind.SPECULATIVE or s.token_capacity == widest[s.batch_capacity]))
