"""The confidence sidecar ``[2, request_slots, draft_capacity]`` (OPEN-16).

Covers ACC-10 (draft capacity = D), ACC-11 (FP32, shape), ACC-12 (every produced prefix
has a finite entry in [0, 1]).
"""

from __future__ import annotations

import torch

from gpu.speculative.confidence import (
    JOINT_PREFIX_PROBABILITY,
    POSITION_CONFIDENCE,
    confidence_sidecar,
    copy_confidence,
    draft_confidence,
    sampled_token_probability,
    sidecar_shape,
    write_confidence_sidecar,
)


def test_acc_11_sidecar_is_float32_with_the_declared_shape() -> None:
    per_position = torch.rand(4, 3, dtype=torch.float64)
    sidecar = confidence_sidecar(per_position)
    assert sidecar.dtype == torch.float32
    assert tuple(sidecar.shape) == sidecar_shape(4, 3) == (2, 4, 3)
    assert confidence_sidecar(torch.zeros(2, 0)).shape == (2, 2, 0)  # width one, D = 0


def test_open_16_planes_are_position_confidence_and_joint_prefix_probability() -> None:
    per_position = torch.tensor([[0.5, 0.5, 0.8], [1.0, 0.25, 0.0]])
    sidecar = confidence_sidecar(per_position)
    assert torch.equal(sidecar[POSITION_CONFIDENCE], per_position)
    assert torch.equal(sidecar[JOINT_PREFIX_PROBABILITY],
                       torch.tensor([[0.5, 0.25, 0.2], [1.0, 0.25, 0.0]]))


def test_acc_12_every_prefix_has_a_finite_probability() -> None:
    per_position = torch.tensor([[float("nan"), 0.5, 1.5, -0.1]])
    sidecar = confidence_sidecar(per_position)
    assert torch.isfinite(sidecar).all()
    assert ((sidecar >= 0) & (sidecar <= 1)).all()
    assert sidecar[POSITION_CONFIDENCE].tolist() == [[0.0, 0.5, 1.0, 0.0]]


def test_write_in_place_matches() -> None:
    per_position = torch.rand(3, 5)
    out = torch.full((2, 3, 5), -7.0)
    write_confidence_sidecar(out, per_position)
    assert torch.equal(out, confidence_sidecar(per_position))


def test_draft_confidence_is_the_top_probability_of_each_draft_distribution() -> None:
    probs = torch.tensor([[[0.1, 0.7, 0.2], [0.4, 0.3, 0.3]]])
    tokens = torch.tensor([[2, -1]])
    assert torch.equal(draft_confidence(probs, tokens >= 0), torch.tensor([[0.7, 0.0]]))
    assert torch.equal(sampled_token_probability(tokens, probs), torch.tensor([[0.2, 0.0]]))


def test_copy_confidence_is_one_for_each_supplied_token() -> None:
    assert copy_confidence(torch.tensor([0, 2, 5]), 3).tolist() == [
        [0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
