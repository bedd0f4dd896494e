"""Copy (n-gram) proposals from a request's own context (seed: SPEC-8, SPEC-9).

Owns the copy proposal source: given a lane's context tokens in a fixed-capacity
device buffer ``[B, C]`` with a length ``[B]`` (the last token is the pending token),
find the most recent earlier occurrence of the context's last ``n`` tokens, trying the
longest ``n`` first (``max_ngram`` down to ``min_ngram``), and propose the tokens that
followed it, at most ``depth`` (D bounds the supplied prefix, SPEC-8) and never past
the end of the context. An occurrence is *earlier* when it ends before the last token;
it may overlap the suffix. Copy proposals are deterministic point masses: they draw no
randomness and feed no learned-draw counters (SPEC-9).

``propose_copy`` is the capturable form (fixed shapes, masks, a static loop over
``n``); ``reference_copy_proposal`` is a plain Python reference for tests;
``append_context`` writes emitted tokens into the buffer in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from gpu.speculative.verification import PAD_TOKEN

COPY_MAX_NGRAM = 3
"""The longest suffix n-gram a copy lookup tries (the programs' default; the planner's
counterfactual copy rounds replay the same lookup, ``actors.copy_counterfactuals``)."""


class CopyProposal(NamedTuple):
    """Copy proposals for a batch of lanes."""

    tokens: torch.Tensor
    """int64 ``[B, D]``: proposed tokens, ``PAD_TOKEN`` from ``proposed`` on."""
    proposed: torch.Tensor
    """int64 ``[B]``: proposed tokens per lane (0 where nothing matched)."""


def _check_ngram_range(min_ngram: int, max_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def propose_copy(
    context: torch.Tensor,
    context_length: torch.Tensor,
    *,
    depth: int,
    max_ngram: int,
    min_ngram: int = 1,
) -> CopyProposal:
    """Copy proposals for ``context [B, C]`` (int64) with ``context_length [B]``."""
    _check_ngram_range(min_ngram, max_ngram)
    batch, capacity = context.shape
    device = context.device
    length = context_length.clamp(min=0, max=capacity)
    end = torch.arange(capacity, device=device, dtype=torch.int64)[None, :]
    best_end = torch.full((batch,), -1, dtype=torch.int64, device=device)
    match = torch.ones((batch, capacity), dtype=torch.bool, device=device)
    for n in range(1, max_ngram + 1):
        # Extend the match of the last n-1 tokens by the token n-1 before the end.
        shift = n - 1
        suffix_token = context.gather(1, (length - 1 - shift).clamp(min=0)[:, None])
        shifted = torch.cat(
            [torch.full((batch, shift), PAD_TOKEN, dtype=context.dtype, device=device),
             context[:, : capacity - shift]], dim=1,
        )
        match = match & (shifted == suffix_token)
        if n < min_ngram:
            continue
        earlier = (end >= shift) & (end <= (length - 2)[:, None])
        last = torch.where(match & earlier, end, -1).amax(dim=1)
        best_end = torch.where(last >= 0, last, best_end)  # longer n wins
    found = best_end >= 0
    count = torch.where(found, (length - 1 - best_end).clamp(max=depth), 0).clamp(min=0)
    j = torch.arange(depth, device=device, dtype=torch.int64)[None, :]
    source = (best_end[:, None] + 1 + j).clamp(min=0, max=capacity - 1)
    tokens = torch.where(j < count[:, None], context.gather(1, source), PAD_TOKEN)
    return CopyProposal(tokens=tokens, proposed=count)


def reference_copy_proposal(
    context: Sequence[int], *, depth: int, max_ngram: int, min_ngram: int = 1
) -> list[int]:
    """The copy proposal for one context, by direct search."""
    _check_ngram_range(min_ngram, max_ngram)
    size = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if size < n + 1:
            continue
        suffix = list(context[size - n:])
        for match_end in range(size - 2, n - 2, -1):
            if list(context[match_end - n + 1: match_end + 1]) == suffix:
                return list(context[match_end + 1: min(match_end + 1 + depth, size)])
    return []


def append_context(
    context: torch.Tensor, context_length: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor
) -> None:
    """Append ``tokens[b, :count[b]]`` (``[B, W]``) to each lane's context in place and
    advance ``context_length``; tokens past the buffer's capacity are dropped."""
    capacity = context.shape[1]
    width = tokens.shape[1]
    slot = torch.arange(capacity, device=context.device, dtype=torch.int64)[None, :]
    offset = slot - context_length[:, None]
    take = (offset >= 0) & (offset < count[:, None])
    values = tokens.gather(1, offset.clamp(min=0, max=max(width - 1, 0)))
    context.copy_(torch.where(take, values, context))
    context_length.copy_((context_length + count).clamp(max=capacity))
