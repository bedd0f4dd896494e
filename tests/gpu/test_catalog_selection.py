"""Load-time capacity selection only narrows the prepared set. Covers SPEC-15: a smaller
batch, fewer prefill capacities, a shallower draft, a narrower completion width or a
feature left off give a subset of the larger load's programs (never a shape the larger
load lacks), and a capacity no program can have is refused at load rather than
fabricated. (A smaller envelope R is different: it caps a ragged program's ``P``,
SPEC-13, which is a program of its own.)"""

from __future__ import annotations

import dataclasses

import pytest

from gpu.catalog import CatalogError, CatalogFlags, build_catalog

FULL = CatalogFlags(max_batch=8, prefill_capacities=(64, 256, 1024), mixed_prefill=True,
                    family_supports_mixed=True, draft_depth=3, speculative_token_capacity=16,
                    device_allocation=True)


@pytest.mark.parametrize("changes", [
    {"max_batch": 4}, {"max_batch": 1}, {"prefill_capacities": (64, 1024)},
    {"draft_depth": 1}, {"completion_token_capacity": 2},
    {"mixed_prefill": False}, {"device_allocation": False},
])
def test_spec_15_reduced_capacities_select_existing_programs(changes: dict[str, object]
                                                            ) -> None:
    full = set(build_catalog(FULL))
    reduced = set(build_catalog(dataclasses.replace(FULL, **changes)))
    assert reduced and reduced < full


@pytest.mark.parametrize("changes", [
    {"max_batch": 3}, {"max_batch": 128}, {"prefill_capacities": (100,)},
    {"prefill_capacities": ()}, {"completion_token_capacity": 9},
])
def test_spec_15_a_capacity_without_a_program_fails_at_load(changes: dict[str, object]
                                                           ) -> None:
    with pytest.raises(CatalogError):
        build_catalog(dataclasses.replace(FULL, **changes))
