"""``CatalogFlags.speculative_mixed``: flare's opt-in speculative load without wider
mixed programs (a departure from MIX-17/MIX-41/MIX-43; MIX-40 and MIX-46 still hold).

The default keeps the seed's catalog: width-one mixed programs at every prompt bucket
plus one wider program per eligible width at the balanced bucket. ``False`` leaves the
wider ones out, so every mixed frame, the only frames carrying a prompt chunk beside
decoders, verifies no drafts."""

from __future__ import annotations

from dataclasses import replace

from gpu.catalog import CatalogFlags, build_catalog, prompt_bucket_ladder
from ops.sim.catalogs import build_catalogs
from policy.descriptors import GraphKind, GraphShape

LOAD = CatalogFlags(max_batch=16, prefill_capacities=(64, 256, 1024), mixed_prefill=True,
                    family_supports_mixed=True, draft_depth=1)


def mixed(flags: CatalogFlags) -> tuple[GraphShape, ...]:
    return build_catalog(flags).of_kind(GraphKind.MIXED)


def width_one(shapes: tuple[GraphShape, ...]) -> set[tuple[int, int]]:
    return {(s.batch_capacity, s.prefill_capacity) for s in shapes
            if s.token_capacity == 1 and s.speculation_enabled}


def test_default_speculative_load_has_wider_mixed_programs() -> None:
    assert any(s.token_capacity > 1 for s in mixed(LOAD))


def test_without_speculative_mixed_no_mixed_program_verifies_drafts() -> None:
    for depth in (1, 4):
        flags = replace(LOAD, draft_depth=depth, speculative_mixed=False)
        shapes = mixed(flags)
        assert shapes
        assert all(s.token_capacity == 1 for s in shapes)
        # MIX-40/MIX-46: every batch bucket >= 2 keeps every prompt bucket at width one,
        # still maintaining the draft context.
        want = {(b, p) for b in (2, 4, 8, 16) for p in prompt_bucket_ladder(1024)}
        assert width_one(shapes) == want == width_one(mixed(replace(LOAD, draft_depth=depth)))
        # The separate speculative programs stay.
        assert any(s.token_capacity > 1 for s in build_catalog(flags).of_kind(
            GraphKind.SPECULATIVE))


def test_the_simulator_catalogs_follow_the_flag() -> None:
    catalogs = build_catalogs(max_batch=16, prefill_capacities=(64, 256, 1024),
                              mixed_prefill=True, draft_depth=1, speculative_mixed=False)
    load_mixed = [s for s in catalogs.speculative if s.kind is GraphKind.MIXED]
    assert load_mixed and all(s.token_capacity == 1 for s in load_mixed)
    default = build_catalogs(max_batch=16, prefill_capacities=(64, 256, 1024),
                             mixed_prefill=True, draft_depth=1)
    assert any(s.kind is GraphKind.MIXED and s.token_capacity > 1
               for s in default.speculative)
