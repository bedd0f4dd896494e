"""Descriptor rules shared by the scheduler and the programs."""

from __future__ import annotations

import pytest

from policy.descriptors import (
    DescriptorError,
    ExecutionTiming,
    GraphKind,
    GraphShape,
    StateOp,
    TargetBinding,
)


def spec(b: int, d: int, w: int, p: int) -> GraphShape:
    return GraphShape(
        kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w, proposal_depth=d,
        packed_capacity=p, binding=TargetBinding.QUERY_LENGTH,
    )


def test_cat_9_seven_graph_kinds() -> None:
    """Covers CAT-9: the catalog's kinds are exactly the seed's seven."""
    assert {k.value for k in GraphKind} == {
        "prefill", "scored_prefill", "decode", "speculative", "mixed", "vision", "state",
    }


def test_spec_1_spec_3_identity_uses_all_four_extents() -> None:
    """Covers SPEC-1, SPEC-3, DUR-4, DUR-7: programs differing only in P or D differ."""
    assert spec(4, 3, 4, 16) != spec(4, 3, 4, 12)
    assert spec(4, 3, 4, 16) != spec(4, 5, 4, 16)
    assert hash(spec(4, 3, 4, 16)) == hash(spec(4, 3, 4, 16))


def test_spec_4_width_one_has_no_proposals() -> None:
    """Covers SPEC-4."""
    with pytest.raises(DescriptorError, match="SPEC-4"):
        spec(4, 2, 1, 4)
    assert spec(4, 0, 1, 4).proposal_depth == 0


def test_mix_2_to_mix_5_mixed_shape_rules() -> None:
    """Covers MIX-2, MIX-3, MIX-4, MIX-5, MIX-16."""
    def mixed(b: int, w: int, c: int) -> GraphShape:
        return GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=w,
                          prefill_capacity=c)

    for bad_b in (1, 3, 128):
        with pytest.raises(DescriptorError):
            mixed(bad_b, 1, 128)
    with pytest.raises(DescriptorError, match="MIX-3"):
        mixed(4, 9, 128)
    for bad_c in (0, 100):
        with pytest.raises(DescriptorError):
            mixed(4, 1, bad_c)
    assert mixed(4, 6, 128).max_packed_extent == 128 + 3 * 6
    with pytest.raises(DescriptorError, match="MIX-5"):
        GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1, prefill_capacity=64)


def test_state_graphs_name_their_operation() -> None:
    with pytest.raises(DescriptorError):
        GraphShape(kind=GraphKind.STATE, batch_capacity=1, token_capacity=0)
    shape = GraphShape(kind=GraphKind.STATE, batch_capacity=2, token_capacity=0,
                       state_op=StateOp.SNAPSHOT)
    assert shape.label() == "state.snapshot[B=2]"


def test_dur_14_dur_15_dur_19_timing_samples() -> None:
    """Covers DUR-14 (max rank interval), DUR-15 (readiness correction), DUR-19."""
    timing = ExecutionTiming(device_intervals_ns=(5_000_000, 9_000_000), wall_ns=20_000_000,
                             readiness_delay_ns=2_000_000)
    assert timing.device_ns == 9_000_000
    assert timing.cost_sample_ns == 7_000_000
    missing = ExecutionTiming(device_intervals_ns=(0,), wall_ns=5_000_000)
    assert missing.device_ns == 0 and missing.cost_sample_ns == 0
