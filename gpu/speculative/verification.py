"""Speculative verification by rejection sampling, and the survival sidecar.

Owns the verification stage of a complete speculative program (seed: *Speculative
graph coverage*, *Completed confidence and acceptance*). Per lane, the target has
evaluated ``length`` rows (``0..W``): the pending token and the first ``length - 1``
drafts, giving target distributions ``p_0..p_(length-1)`` for the positions
``position .. position + length - 1``. Draft ``d_j`` (drawn from ``q_j``) is accepted
with probability ``min(1, p_j(d_j) / q_j(d_j))`` using a counter-based uniform; the
first rejection stops the lane and its position takes a token from the residual
``max(0, p_j - q_j)`` (normalised); a lane whose verified drafts are all accepted takes
a bonus token from ``p_(length-1)``. Emitted tokens therefore follow the target
distribution exactly. Greedy rows are one-hot (``distributions.filtered_probs``), which
makes this exact greedy verification: accept while the draft equals the target argmax,
emit the target's greedy tokens.

Fixed shapes ``[B, W]`` and masks/cumulative products only: no host sync, no
data-dependent shapes, capturable. Survival (ACC-27) is the cumulative product of the
clipped ratios over the evaluated prefixes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu.sampling import reported_log_probs
from gpu.speculative.randomness import acceptance_uniforms, gumbel_noise

PAD_TOKEN = -1
"""Token value in emitted-token slots past a lane's emitted count, and for absent drafts."""

SURVIVAL_OUTPUT = "completion_speculative_survival"
"""The output name a program gives ``Verification.survival`` (ACC-27)."""


class Verification(NamedTuple):
    """Per-lane result of ``verify_drafts`` (all device tensors)."""

    tokens: torch.Tensor
    """int64 ``[B, W]``: emitted tokens (accepted drafts, then the correction or bonus
    token); ``PAD_TOKEN`` from index ``emitted`` on."""
    emitted: torch.Tensor
    """int64 ``[B]``: ``accepted + 1`` for lanes with ``length >= 1``, else 0."""
    accepted: torch.Tensor
    """int64 ``[B]``: accepted drafts (the accepted prefix length)."""
    next_token: torch.Tensor
    """int64 ``[B]``: the last emitted token (the lane's new pending token);
    meaningless where ``emitted == 0``."""
    survival: torch.Tensor
    """float32 ``[B, W-1]``: ``completion_speculative_survival`` (ACC-27): entry ``j``
    is ``prod_(i<=j) min(1, p_i(d_i)/q_i(d_i))`` for evaluated prefixes
    (``j < length - 1``), 0 for prefixes not evaluated."""
    evaluated: torch.Tensor
    """int64 ``[B]``: drafts the target evaluated, ``max(length - 1, 0)``; survival
    entries at ``j >= evaluated`` carry no observation."""


def _acceptance_ratio(target_of_draft: torch.Tensor, draft_of_draft: torch.Tensor) -> torch.Tensor:
    """``min(1, p(d)/q(d))``; a draft the draft distribution gives no mass (only an
    inconsistent caller can produce one) is accepted where the target gives it mass."""
    ratio = target_of_draft / draft_of_draft.clamp(min=torch.finfo(torch.float32).tiny)
    return ratio.clamp(max=1.0)


def _correction_weights(
    target_row: torch.Tensor, draft_row: torch.Tensor, rejected: torch.Tensor
) -> torch.Tensor:
    """Unnormalised weights of the token emitted after the accepted prefix: the residual
    ``max(0, p - q)`` after a rejection, ``p`` itself for the bonus. A residual with no
    mass left by rounding falls back to ``p``."""
    residual = (target_row - draft_row).clamp(min=0.0)
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    use_residual = rejected[:, None] & has_mass
    return torch.where(use_residual, residual, target_row)


def _clipped_ratios(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(clipped [B, W-1], present [B, W-1], safe_drafts [B, W-1])``: the clipped
    ratio per draft (0 for absent drafts), which drafts are present, and the draft ids
    clamped into the vocabulary for gathers."""
    depth = target_probs.shape[1] - 1
    present = draft_tokens >= 0
    safe_drafts = draft_tokens.clamp(min=0, max=target_probs.shape[-1] - 1)
    p_of_draft = target_probs[:, :depth].float().gather(2, safe_drafts[..., None]).squeeze(2)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(2, safe_drafts[..., None]).squeeze(2).float()
    clipped = torch.where(present, _acceptance_ratio(p_of_draft, q_of_draft), 0.0)
    return clipped, present, safe_drafts


def _assemble(*, draft_tokens: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor,
              final: torch.Tensor, survival: torch.Tensor,
              evaluated: torch.Tensor) -> Verification:
    """The emitted rows of a verification: the accepted drafts, then the final token,
    ``PAD_TOKEN`` after it; inactive lanes (length 0) emit nothing."""
    batch, depth = draft_tokens.shape
    device = draft_tokens.device
    active = lengths > 0
    emitted = torch.where(active, accepted + 1, 0)
    w = torch.arange(depth + 1, device=device, dtype=torch.int64)[None, :]
    padded_drafts = torch.cat(
        [draft_tokens, torch.full((batch, 1), PAD_TOKEN, dtype=torch.int64, device=device)], dim=1
    )
    tokens = torch.where(w < accepted[:, None], padded_drafts, PAD_TOKEN)
    tokens = torch.where((w == accepted[:, None]) & active[:, None], final[:, None], tokens)
    return Verification(
        tokens=tokens, emitted=emitted, accepted=torch.where(active, accepted, 0),
        next_token=final, survival=survival, evaluated=evaluated,
    )


def verify_drafts(
    *,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    lengths: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> Verification:
    """Verify per-lane drafts against the target by rejection sampling.

    - ``draft_tokens`` int64 ``[B, W-1]``: draft ``j`` proposes the token at sequence
      position ``position + j``; ``PAD_TOKEN`` (any negative value) marks an absent
      draft, which is never accepted.
    - ``draft_probs`` float ``[B, W-1, V]``: the draft distribution each draft was drawn
      from, or ``None`` for deterministic drafts (copy proposals, point masses).
    - ``target_probs`` float ``[B, W, V]``: the target's sampling distribution at
      positions ``position .. position + W - 1`` (row 0 from the pending token).
    - ``lengths`` int64 ``[B]`` in ``0..W``: target rows the lane evaluated (host query
      lengths or the device allocation); 0 for idle lanes.
    - ``seed``, ``position`` int64 ``[B]``: the request seed and the sequence position of
      the lane's first produced token (the pending token's position + 1).
    """
    batch, width, vocab = target_probs.shape
    depth = width - 1
    if draft_tokens.shape != (batch, depth):
        raise ValueError(f"draft_tokens must be [{batch}, {depth}], got {tuple(draft_tokens.shape)}")
    device = target_probs.device
    target_probs = target_probs.float()
    j = torch.arange(depth, device=device, dtype=torch.int64)[None, :]
    lengths = lengths.clamp(min=0, max=width)
    evaluated = (lengths - 1).clamp(min=0)

    clipped, present, safe_drafts = _clipped_ratios(draft_tokens, draft_probs, target_probs)

    verified = j < evaluated[:, None]
    uniform = acceptance_uniforms(seed, position, depth)
    accept = verified & (uniform < clipped)
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    survival = torch.where(verified, clipped.cumprod(dim=1), 0.0)

    # The token after the accepted prefix, at depth `accepted` (gathered, fixed shape).
    at = accepted[:, None, None].expand(batch, 1, vocab)
    target_row = target_probs.gather(1, at).squeeze(1)
    rejected = accepted < evaluated
    if depth == 0:
        draft_row = torch.zeros_like(target_row)
    else:
        at_draft = accepted.clamp(max=depth - 1)
        if draft_probs is None:
            token_at = safe_drafts.gather(1, at_draft[:, None])
            draft_row = torch.zeros_like(target_row).scatter(1, token_at, 1.0)
        else:
            draft_row = draft_probs.gather(
                1, at_draft[:, None, None].expand(batch, 1, vocab)).squeeze(1).float()
        draft_present = present.gather(1, at_draft[:, None])
        draft_row = torch.where(draft_present, draft_row, 0.0)
    weights = _correction_weights(target_row, draft_row, rejected)
    noise = gumbel_noise(seed, position + accepted, vocab)  # the ordinary sampler's stream
    final = (torch.log(weights) + noise).argmax(dim=-1)

    return _assemble(draft_tokens=draft_tokens, lengths=lengths, accepted=accepted,
                     final=final, survival=survival.float(), evaluated=evaluated)


def verify_greedy(
    *,
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    lengths: torch.Tensor,
    vocab_size: int,
) -> Verification:
    """``verify_drafts`` for lanes that are all greedy, from the target's greedy tokens
    alone: the same ``Verification``, without the ``[B, W, V]`` distributions.

    ``target_tokens`` int64 ``[B, W]`` is ``distributions.greedy_tokens`` of the target
    logits (where ``filtered_probs`` puts its one-hot). With one-hot target rows and
    one-hot (learned, greedy) or point-mass (copy) drafts, ``verify_drafts`` reduces
    exactly to this: the clipped ratio of a present draft is 1 when it equals the
    target token and 0 otherwise, so a uniform in (0, 1) accepts exactly the matches;
    the correction or bonus weights are the target one-hot at depth ``accepted`` (the
    residual of two different one-hots is the target's), so Gumbel-max returns the
    target token; survival is the cumulative product of the 0/1 ratios. Every output
    equals ``verify_drafts``'s bit for bit (``tests/gpu/test_speculative_verification.py``).
    """
    batch, width = target_tokens.shape
    depth = width - 1
    if draft_tokens.shape != (batch, depth):
        raise ValueError(f"draft_tokens must be [{batch}, {depth}], got {tuple(draft_tokens.shape)}")
    device = target_tokens.device
    j = torch.arange(depth, device=device, dtype=torch.int64)[None, :]
    lengths = lengths.clamp(min=0, max=width)
    evaluated = (lengths - 1).clamp(min=0)
    safe_drafts = draft_tokens.clamp(min=0, max=vocab_size - 1)
    match = (draft_tokens >= 0) & (safe_drafts == target_tokens[:, :depth])
    verified = j < evaluated[:, None]
    accepted = (verified & match).to(torch.int64).cumprod(dim=1).sum(dim=1)
    survival = torch.where(verified, match.to(torch.float32).cumprod(dim=1), 0.0)
    final = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    return _assemble(draft_tokens=draft_tokens, lengths=lengths, accepted=accepted,
                     final=final, survival=survival, evaluated=evaluated)


def speculative_survival(
    *,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """``completion_speculative_survival`` alone (ACC-27), float32 ``[B, W-1]``:
    cumulative products of ``min(1, p(token)/q(token))`` over the evaluated prefixes,
    0 past them. Equal to ``verify_drafts(...).survival``; it draws no randomness and
    never influences tokens or allocation (ACC-29)."""
    width = target_probs.shape[1]
    j = torch.arange(width - 1, device=target_probs.device, dtype=torch.int64)[None, :]
    clipped, _, _ = _clipped_ratios(draft_tokens, draft_probs, target_probs)
    verified = j < (lengths.clamp(min=0, max=width) - 1)[:, None]
    return torch.where(verified, clipped.cumprod(dim=1), 0.0).float()


def target_log_probs(target_logits: torch.Tensor) -> torch.Tensor:
    """The log-probabilities ``float32 [..., V]`` that raw reported logprobs use: the
    sampler's ``gpu.sampling.reported_log_probs`` of the target's logits (processed
    logprobs: ``processed_log_probs_by_lane``)."""
    return reported_log_probs(target_logits)


def pick_logprobs(log_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_probs [B, W, V]`` (``target_log_probs``) at ``tokens [B, W]``; NaN at
    ``PAD_TOKEN`` slots."""
    picked = log_probs.gather(2, tokens.clamp(min=0)[..., None]).squeeze(2)
    return torch.where(tokens >= 0, picked, float("nan"))


def emitted_logprobs(target_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probabilities float32 ``[B, W]`` of emitted ``tokens [B, W]`` under the
    target's unfiltered temperature-1 distribution (what OpenAI ``logprobs`` report,
    as ``gpu.sampling.sample`` does), from ``target_logits [B, W, V]``; NaN at
    ``PAD_TOKEN`` slots."""
    return pick_logprobs(target_log_probs(target_logits), tokens)
