"""Whole speculative rounds composed from the kernels on a toy target model (a table
of logits indexed by the last two tokens): greedy output with speculation equals greedy
output without it, token for token, for copy and learned drafts and for host (fixed)
and device allocation. Sampled lanes carry seeds that make the rounds reproducible.
Covers greedy equivalence at the kernel level, SPEC-8, SPEC-23,
SPEC-24, SPEC-28.
"""

from __future__ import annotations

import pytest
import torch

from gpu.speculative import (
    allocate_target_rows,
    append_context,
    confidence_sidecar,
    copy_confidence,
    draft_confidence,
    filtered_probs,
    propose_copy,
    sample_draft_tokens,
    verify_drafts,
)

VOCAB, BATCH, CAPACITY, DEPTH, PROMPT, GENERATE = 5, 6, 64, 3, 8, 30
WIDTH = DEPTH + 1
ROWS = 13  # ragged P < B * W = 24


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    target = torch.randn(VOCAB, VOCAB, VOCAB, generator=gen) * 3
    draft = target + torch.randn(VOCAB, VOCAB, VOCAB, generator=gen)  # a decent draft
    return target, draft


def _greedy_probs(logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    return filtered_probs(logits, temperature=torch.zeros(n), top_p=torch.ones(n),
                          top_k=torch.zeros(n, dtype=torch.int64))


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    context = torch.zeros(BATCH, CAPACITY, dtype=torch.int64)
    context[:, :PROMPT] = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen)
    return context, torch.full((BATCH,), PROMPT)


def _plain_greedy(target: torch.Tensor) -> torch.Tensor:
    context, _ = _prompts()
    for i in range(PROMPT, PROMPT + GENERATE):
        context[:, i] = target[context[:, i - 2], context[:, i - 1]].argmax(dim=-1)
    return context[:, : PROMPT + GENERATE]


def _speculative_greedy(source: str, allocation: str) -> tuple[torch.Tensor, int]:
    target, draft_table = _tables()
    context, length = _prompts()
    accepted_total = 0
    lanes = torch.arange(BATCH)
    while bool((length < PROMPT + GENERATE).any()):
        last2, last1 = context[lanes, length - 2], context[lanes, length - 1]
        if source == "copy":
            proposal = propose_copy(context, length, depth=DEPTH, max_ngram=3)
            drafts, draft_probs = proposal.tokens, None
            confidence = copy_confidence(proposal.proposed, DEPTH)
            available = proposal.proposed + 1
        else:
            tokens, rows, a, b = [], [], last2, last1
            for j in range(DEPTH):
                q = _greedy_probs(draft_table[a, b])
                token = sample_draft_tokens(q, lanes, length + j, length - 1)
                tokens.append(token)
                rows.append(q)
                a, b = b, token
            drafts, draft_probs = torch.stack(tokens, 1), torch.stack(rows, 1)
            confidence = draft_confidence(draft_probs, drafts >= 0)
            available = torch.full((BATCH,), WIDTH)
        remaining = PROMPT + GENERATE - length
        ceilings = torch.minimum(torch.minimum(available, remaining), torch.tensor(WIDTH))
        if allocation == "device":
            lengths = allocate_target_rows(confidence_sidecar(confidence)[1], ceilings, ROWS)
            assert int(lengths.sum()) <= ROWS
        else:
            lengths = ceilings
        assert ((lengths >= 1) | (ceilings == 0)).all() and (lengths <= ceilings).all()
        history = torch.cat([last2[:, None], last1[:, None], drafts.clamp(min=0)], dim=1)
        target_logits = torch.stack(
            [target[history[:, i], history[:, i + 1]] for i in range(WIDTH)], dim=1)
        target_probs = _greedy_probs(target_logits.reshape(-1, VOCAB)).reshape(
            BATCH, WIDTH, VOCAB)
        result = verify_drafts(draft_tokens=drafts, draft_probs=draft_probs,
                               target_probs=target_probs, lengths=lengths, seed=lanes,
                               position=length)
        accepted_total += int(result.accepted.sum())
        append_context(context, length, result.tokens, result.emitted)
    return context[:, : PROMPT + GENERATE], accepted_total


@pytest.mark.parametrize("source", ["copy", "learned"])
@pytest.mark.parametrize("allocation", ["host", "device"])
def test_greedy_speculation_equals_plain_greedy(source: str, allocation: str) -> None:
    target, _ = _tables()
    output, accepted = _speculative_greedy(source, allocation)
    assert torch.equal(output, _plain_greedy(target))
    assert accepted > 0  # drafts were actually accepted, so speculation did something
