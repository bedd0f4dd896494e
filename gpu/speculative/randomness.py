"""Counter-based randomness for speculative rounds: independent streams per purpose.

``gpu.sampling.counter_uniform(seed, position, width)`` is a pure hash of
(request seed, sequence position, column). Rejection sampling needs three draws per
produced position that are independent of each other: the draft token, the
acceptance uniform, and the correction (residual or bonus) token. This module derives
one keyed seed per purpose and feeds it to ``counter_uniform``, so every draw stays a
pure function of its key: reproducible whatever else is in the batch, capturable (no
global generator, no host sync, fixed shapes).

Streams (see ``docs/speculation.md``):

- *correction*: the request's own seed, unchanged. The residual or bonus token at a
  position therefore uses exactly the noise ordinary decoding uses at that position, so
  a lane that verifies no drafts samples what the ordinary sampler would.
- *acceptance*: the seed mixed with a stream constant.
- *draft*: the seed mixed with a stream constant *and the round's start position*.
  A round's discarded drafts (past its first rejection) still shape that round's
  device allocation for other lanes; keying draft noise by the round makes a later
  round's drafts at the same positions fresh draws, so nothing already committed,
  in any request, carries information about them.
"""

from __future__ import annotations

import torch

from gpu.sampling import counter_uniform, mix32

_MASK32 = 0xFFFFFFFF

ACCEPTANCE_STREAM = 0x41434350  # "ACCP"
DRAFT_STREAM = 0x44524654  # "DRFT"


def stream_seed(seed: torch.Tensor, stream: int, salt: torch.Tensor | None = None) -> torch.Tensor:
    """A keyed int64 seed for ``stream`` (and an optional per-lane int64 ``salt``).

    Both 32-bit halves of ``seed`` are XORed with hashes of (stream, salt), so two
    streams of one request never share noise, and structured user seeds (0, 1, 2, ...)
    stay far apart."""
    key = torch.full_like(seed, stream & _MASK32)
    if salt is not None:
        key = key ^ mix32(salt & _MASK32)
    low = mix32(key)
    high = mix32(low ^ 0x9E3779B9) & 0x7FFFFFFF  # keep the result non-negative
    return seed ^ ((high << 32) | low)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, width: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[N, width]`` from ``counter_uniform`` (same as the sampler's)."""
    uniform = counter_uniform(seed, position, width)
    return -torch.log(-torch.log(uniform))


def sample_from_probs(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (unnormalised weights are fine), by
    Gumbel-max over ``log(probs)``, keyed by (``seed[n]``, ``position[n]``).

    A row with no positive weight returns token 0; callers never pass one."""
    noise = gumbel_noise(seed, position, probs.shape[-1])
    return (torch.log(probs) + noise).argmax(dim=-1)


def sample_draft_tokens(
    draft_probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
    round_start: torch.Tensor,
) -> torch.Tensor:
    """Draft tokens from ``draft_probs [N, V]`` on the draft stream, keyed by the
    request seed, the draft token's sequence position and the round's start position
    (the position of the round's pending token)."""
    return sample_from_probs(draft_probs, stream_seed(seed, DRAFT_STREAM, round_start), position)


def acceptance_uniforms(seed: torch.Tensor, first_position: torch.Tensor, depth: int) -> torch.Tensor:
    """Acceptance uniforms ``[B, depth]`` in (0, 1): entry ``j`` is keyed by the
    sequence position ``first_position[b] + j`` of the draft it tests."""
    batch = seed.shape[0]
    offsets = torch.arange(depth, device=seed.device, dtype=torch.int64)
    positions = (first_position[:, None] + offsets[None, :]).reshape(-1)
    seeds = stream_seed(seed, ACCEPTANCE_STREAM)[:, None].expand(batch, depth).reshape(-1)
    return counter_uniform(seeds, positions, 1).reshape(batch, depth)
