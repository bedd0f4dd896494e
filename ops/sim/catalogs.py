"""The prepared shapes each simulated policy runs on, as ``flare run`` would load them.

A server without speculation prepares the ordinary catalog; one with a draft (``flare
run --draft-model``/``--draft-source copy``, draft depth D) prepares the speculative
load of ``gpu.catalog.build_catalog`` (rectangular ``QueryLength`` programs of widths
1..D+1, width-one mixed programs that keep the draft context, and wider mixed programs
whose speculative decode rows the speculating ``Scheduler`` plans). Fixed-width mode
(``spec-fixed``) serves ``gpu.catalog.fixed_width_shapes`` of that load, the subset
``actors.catalog_setup.served_shapes`` keeps: per batch bucket only the speculative and mixed
programs of the widest speculative width, and the ordinary decode programs, which only
grammar-constrained requests run on (MIX-7, LRN-10, SEL-13).

So a simulated comparison puts each policy on the catalog its real server would have:
non-speculative policies on the ordinary catalog, ``spec-adaptive`` and ``fixed-spec-K``
on the speculative load, ``spec-fixed`` on its fixed-width subset. Like ``flare run``
(``RuntimeConfig.state_operations``), no catalog holds state-operation programs unless
asked (``--state-operations``): without a snapshot program the seed's scheduler plans no
terminal capture, and a finished request is released at once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpu.catalog import CatalogFlags, build_catalog, fixed_width_shapes
from policy.baselines import speculative_policy
from policy.descriptors import GraphShape

DEFAULT_DRAFT_DEPTH = 4
"""``flare run``'s default ``--draft-depth``."""

NO_SPECULATIVE_MIXED_HELP = (
    "leave the speculative load's mixed programs above width one out (as flare run "
    "--no-speculative-mixed): a frame carrying a prompt chunk verifies no drafts; flare's "
    "opt-in departure from MIX-41/MIX-43")
"""``--no-speculative-mixed``'s help in ``flare sim`` and ``flare sim-capacity``."""

STATE_OPERATIONS_HELP = (
    "also prepare the state-operation programs (RuntimeConfig.state_operations, off in "
    "flare run), so the seed's scheduler ends each completion its checkpoint allowance "
    "pays for with a terminal snapshot frame (PRE-38..53)")
"""The help of ``--state-operations`` (``flare sim``, ``flare sim-capacity``) and of
``flare bench speculation --simulate-state-operations``."""


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
                   speculative_token_capacity: int = 0,
                   speculative_mixed: bool = True,
                   state_operations: bool = False) -> Catalogs:
    """All three catalogs from ``flare run``'s catalog flags (``CatalogError`` on bad
    flags; ``draft_depth`` 0 leaves the speculative ones empty; ``speculative_mixed``
    False drops the speculative load's mixed programs above width one, as ``flare run
    --no-speculative-mixed``; ``state_operations`` adds the snapshot, restore, copy and
    initialize programs ``flare run`` leaves out by default)."""
    def catalog(depth: int) -> tuple[GraphShape, ...]:
        return build_catalog(CatalogFlags(
            max_batch=max_batch, prefill_capacities=tuple(prefill_capacities),
            mixed_prefill=mixed_prefill, family_supports_mixed=True, draft_depth=depth,
            speculative_token_capacity=speculative_token_capacity,
            speculative_mixed=speculative_mixed,
            state_operations=state_operations)).shapes

    ordinary = catalog(0)
    if draft_depth <= 0:
        return Catalogs(ordinary, (), ())
    load = catalog(draft_depth)  # adaptive mode serves every generated program
    return Catalogs(ordinary, load, fixed_width_shapes(load))
