"""Device allocation of target rows under SpeculativePrefixLimit, and the packed layout.

Covers SPEC-22 (ceilings bound lengths), SPEC-23 (sum within P), SPEC-24 (the cohort
never changes), SPEC-25/26 (ceilings may sum above P), SPEC-28 (greedy causal frontier
by joint prefix probability), SPEC-29 (ties: shorter prefix, then lower slot).
"""

from __future__ import annotations

import random

import pytest
import torch

from gpu.speculative.allocation import (
    allocate_target_rows,
    packed_layout,
    reference_allocation,
    unpack_lane_rows,
)
from gpu.speculative.confidence import confidence_sidecar


def _allocate(joint: list[list[float]], ceilings: list[int], total_rows: int) -> list[int]:
    depth = len(joint[0]) if joint else 0
    tensor = torch.tensor(joint, dtype=torch.float32).reshape(len(ceilings), depth)
    result: list[int] = allocate_target_rows(tensor, torch.tensor(ceilings), total_rows).tolist()
    return result


def test_spec_28_admits_the_best_immediate_frontier() -> None:
    """Lane 0's second prefix (0.1) only becomes eligible after its first (0.9)."""
    joint = [[0.9, 0.1], [0.5, 0.45]]
    assert _allocate(joint, [3, 3], 3) == [2, 1]
    assert _allocate(joint, [3, 3], 4) == [2, 2]
    assert _allocate(joint, [3, 3], 5) == [2, 3]
    assert _allocate(joint, [3, 3], 6) == [3, 3]


def test_spec_29_ties_go_to_the_shorter_prefix_then_the_lower_slot() -> None:
    joint = [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    assert _allocate(joint, [3, 3, 3], 4) == [2, 1, 1]  # lower slot first
    assert _allocate(joint, [3, 3, 3], 5) == [2, 2, 1]
    assert _allocate(joint, [3, 3, 3], 6) == [2, 2, 2]  # shorter prefixes before depth 2
    assert _allocate(joint, [3, 3, 3], 7) == [3, 2, 2]
    # A higher slot's shorter prefix beats a lower slot's longer one at equal probability.
    assert _allocate([[0.5, 0.5], [0.5, 0.2]], [3, 3], 4) == [2, 2]


def test_spec_22_to_26_ceilings_bound_lanes_and_may_sum_above_p() -> None:
    joint = [[0.9, 0.8, 0.7], [0.9, 0.8, 0.7], [0.1, 0.1, 0.1]]
    lengths = _allocate(joint, [2, 4, 1], 6)  # ceilings sum to 7 > P = 6
    assert lengths == [2, 3, 1]
    assert all(n <= c for n, c in zip(lengths, [2, 4, 1], strict=True))


def test_spec_24_every_active_lane_keeps_its_pending_row_and_idle_lanes_get_none() -> None:
    joint = [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert _allocate(joint, [3, 0, 3], 3) == [1, 0, 2]
    assert _allocate(joint, [3, 3, 3], 3) == [1, 1, 1]


def test_p_below_the_request_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="P=2"):
        allocate_target_rows(torch.ones(3, 2), torch.full((3,), 3), 2)


def test_allocation_equals_the_reference_on_random_confidences_with_ties() -> None:
    """Covers SPEC-28, SPEC-29 on 400 random cases with quantised (tied) confidences."""
    rng = random.Random(2026)
    for _ in range(400):
        batch, depth = rng.randint(1, 7), rng.randint(0, 5)
        levels = [0.0, 0.25, 0.5, 0.75, 1.0]
        per_position = torch.tensor(
            [[rng.choice(levels) for _ in range(depth)] for _ in range(batch)],
            dtype=torch.float32).reshape(batch, depth)
        joint = confidence_sidecar(per_position)[1]
        ceilings = [rng.choice([0, *range(1, depth + 3)]) for _ in range(batch)]
        total = rng.randint(batch, batch * (depth + 1) + 2)
        got = allocate_target_rows(joint, torch.tensor(ceilings), total).tolist()
        want = reference_allocation(joint.tolist(), ceilings, total)
        assert got == want, (joint.tolist(), ceilings, total)
        capacity = [min(c, depth + 1) for c in ceilings]
        assert sum(got) == min(total, sum(capacity))  # no row left unused while any fits
        assert all(n <= c for n, c in zip(got, capacity, strict=True))


def test_nan_confidence_counts_as_zero() -> None:
    joint = torch.tensor([[float("nan"), float("nan")], [0.3, 0.2]])
    assert allocate_target_rows(joint, torch.tensor([3, 3]), 4).tolist() == [1, 3]


def test_packed_layout_places_lanes_contiguously_in_slot_order() -> None:
    lengths = torch.tensor([2, 0, 3, 1])
    layout = packed_layout(lengths, 8)
    assert layout.row_used.tolist() == [True] * 6 + [False] * 2
    assert layout.row_lane[:6].tolist() == [0, 0, 2, 2, 2, 3]
    assert layout.row_depth[:6].tolist() == [0, 1, 0, 1, 2, 0]
    assert layout.lane_offset.tolist() == [0, 2, 2, 5]
    packed = torch.arange(8) * 10
    lanes = unpack_lane_rows(packed, layout, 3)
    assert lanes[0, :2].tolist() == [0, 10]
    assert lanes[2].tolist() == [20, 30, 40]
    assert lanes[3, :1].tolist() == [50]
