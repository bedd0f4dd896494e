"""The FP32 confidence sidecar ``[2, request_slots, draft_capacity]`` (ACC-10..12, OPEN-16).

Owns the sidecar's layout and its construction. flare's decision for OPEN-16, the
meaning of the leading dimension:

- ``sidecar[POSITION_CONFIDENCE, b, j]`` (index 0): the draft's confidence at draft
  position ``j + 1`` given the drafted prefix before it: the probability of the draft
  distribution's most likely token, ``max_x q_j(x)`` (for a greedy draft exactly
  ``q_j(d_j)``), 1 for a present copy proposal (a point mass), 0 where no draft exists;
- ``sidecar[JOINT_PREFIX_PROBABILITY, b, j]`` (index 1): the joint prefix probability
  of the draft prefix ``1..j+1``, the cumulative product of index 0 along ``j``. This
  is what device allocation ranks (SPEC-28) and what the host's confidence forecast
  averages (ACC-18).

Why ``max q`` and not the sampled token's own ``q_j(d_j)``: device allocation decides
whether draft ``j`` is verified from these values, and rejection sampling is exact
only if that decision is independent of the draft token it tests. ``max_x q_j(x)``
depends on the prefix ``d_1..d_(j-1)`` only; ``q_j(d_j)`` depends on ``d_j`` itself and
biases the output (``tests/gpu/test_speculative_verification.py`` measures it).

Both planes cover every produced prefix ``1..D`` (ACC-12): every entry is finite and in
``[0, 1]`` (NaN becomes 0), and the joint plane is non-increasing along ``j``.
Idle lanes hold zeros. ``draft_capacity`` equals the program's actual D
(``confidence_width``, ACC-10).
"""

from __future__ import annotations

import torch

POSITION_CONFIDENCE = 0
JOINT_PREFIX_PROBABILITY = 1
SIDECAR_DTYPE = torch.float32


def sidecar_shape(request_slots: int, draft_capacity: int) -> tuple[int, int, int]:
    """The sidecar's shape for a program with B ``request_slots`` and depth D."""
    return (2, request_slots, draft_capacity)


def draft_confidence(draft_probs: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Per-position confidence float32 ``[B, D]`` of learned drafts: ``max_x q_j(x)`` of
    the distributions ``[B, D, V]`` the drafts were drawn from, 0 where ``present``
    ``[B, D]`` is false. A function of the drafted prefix only, never of the token drawn
    at that position (see the module docstring)."""
    top = draft_probs.float().amax(dim=-1)
    return torch.where(present, top, 0.0)


def sampled_token_probability(draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``q_j(d_j)`` float32 ``[B, D]``, 0 where a draft is absent (negative token).

    Diagnostic only: this depends on the drawn token, so it must never drive
    allocation (it would bias verification; see the module docstring)."""
    safe = draft_tokens.clamp(min=0, max=draft_probs.shape[-1] - 1)
    q = draft_probs.float().gather(2, safe[..., None]).squeeze(2)
    return torch.where(draft_tokens >= 0, q, 0.0)


def copy_confidence(proposed: torch.Tensor, draft_capacity: int) -> torch.Tensor:
    """Per-position confidence ``[B, D]`` of copy proposals: 1 for each of the
    ``proposed[b]`` supplied tokens (a point-mass draft), 0 past them."""
    j = torch.arange(draft_capacity, device=proposed.device, dtype=torch.int64)[None, :]
    return (j < proposed[:, None]).to(SIDECAR_DTYPE)


def confidence_sidecar(position_confidence: torch.Tensor) -> torch.Tensor:
    """The sidecar ``float32 [2, B, D]`` from per-position confidences ``[B, D]``.

    Values are cleaned to ``[0, 1]`` (NaN to 0) before the joint plane is formed, so
    the joint plane is a true non-increasing cumulative product."""
    cleaned = torch.nan_to_num(position_confidence.to(SIDECAR_DTYPE), nan=0.0).clamp(0.0, 1.0)
    return torch.stack([cleaned, cleaned.cumprod(dim=1)])


def write_confidence_sidecar(out: torch.Tensor, position_confidence: torch.Tensor) -> None:
    """In-place version for a program's static output buffer ``out [2, B, D]``."""
    cleaned = torch.nan_to_num(position_confidence.to(SIDECAR_DTYPE), nan=0.0).clamp(0.0, 1.0)
    out[POSITION_CONFIDENCE].copy_(cleaned)
    torch.cumprod(cleaned, dim=1, out=out[JOINT_PREFIX_PROBABILITY])
