"""Copy (n-gram) proposals from a request's own context.

Covers SPEC-8 (D bounds the supplied prefix) and the proposer's rule: the most recent
earlier occurrence of the longest matching suffix n-gram, falling back to shorter n.
"""

from __future__ import annotations

import random

import pytest
import torch

from gpu.speculative.copy_proposals import append_context, propose_copy, reference_copy_proposal
from gpu.speculative.verification import PAD_TOKEN


def _propose(contexts: list[list[int]], capacity: int, **kwargs: int) -> list[list[int]]:
    buffer = torch.full((len(contexts), capacity), 99, dtype=torch.int64)
    for b, ctx in enumerate(contexts):
        buffer[b, : len(ctx)] = torch.tensor(ctx, dtype=torch.int64)
    lengths = torch.tensor([len(c) for c in contexts])
    proposal = propose_copy(buffer, lengths, **kwargs)
    out = []
    for b in range(len(contexts)):
        count = int(proposal.proposed[b])
        assert (proposal.tokens[b, count:] == PAD_TOKEN).all()
        out.append(proposal.tokens[b, :count].tolist())
    return out


def test_the_most_recent_occurrence_of_the_longest_suffix_wins() -> None:
    context = [5, 1, 2, 7, 8, 3, 1, 2, 9, 4, 6, 2, 1, 2]
    # "1 2" ends at 2 and 7; the most recent (7) is followed by 9 4 6 ...
    assert _propose([context], 20, depth=3, max_ngram=2) == [[9, 4, 6]]
    # With n up to 3, "2 1 2" never occurred; "1 2" still applies.
    assert _propose([context], 20, depth=3, max_ngram=3) == [[9, 4, 6]]
    # "6 2 1 2"... the 3-gram "3 1 2" exists only if the suffix matches: make it so.
    longer = [3, 1, 2, 7, 7, 1, 2, 8, 3, 1, 2]
    assert _propose([longer], 20, depth=2, max_ngram=3) == [[7, 7]]  # "3 1 2" at 0..2
    assert _propose([longer], 20, depth=2, max_ngram=2) == [[8, 3]]  # "1 2" at 5..6


def test_spec_8_depth_bounds_the_supplied_prefix() -> None:
    context = [1, 2, 3, 4, 5, 6, 7, 1]
    assert _propose([context], 10, depth=3, max_ngram=1) == [[2, 3, 4]]
    assert _propose([context], 10, depth=0, max_ngram=1) == [[]]
    # never past the end of the context
    assert _propose([[4, 9, 4]], 10, depth=5, max_ngram=1) == [[9, 4]]


def test_no_match_or_too_short_proposes_nothing() -> None:
    assert _propose([[1, 2, 3], [7], []], 4, depth=3, max_ngram=2) == [[], [], []]
    assert _propose([[1, 2, 5, 2]], 6, depth=2, max_ngram=3, min_ngram=2) == [[]]
    with pytest.raises(ValueError):
        propose_copy(torch.zeros(1, 4, dtype=torch.int64), torch.ones(1), depth=2, max_ngram=0)


def test_copy_proposals_equal_the_reference_on_random_contexts() -> None:
    rng = random.Random(17)
    capacity = 24
    for depth, max_ngram, min_ngram in [(1, 1, 1), (3, 2, 1), (4, 3, 2), (5, 4, 1), (2, 3, 3)]:
        contexts = [[rng.randrange(3) for _ in range(rng.randint(0, capacity))]
                    for _ in range(60)]
        got = _propose(contexts, capacity, depth=depth, max_ngram=max_ngram, min_ngram=min_ngram)
        want = [reference_copy_proposal(c, depth=depth, max_ngram=max_ngram, min_ngram=min_ngram)
                for c in contexts]
        assert got == want


def test_append_context_writes_emitted_tokens_after_the_length() -> None:
    context = torch.tensor([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0], [4, 4, 4, 4, 0]])
    lengths = torch.tensor([2, 1, 4])
    tokens = torch.tensor([[7, 8, -1], [9, -1, -1], [5, 6, -1]])
    append_context(context, lengths, tokens, torch.tensor([2, 0, 2]))
    assert context.tolist() == [[1, 2, 7, 8, 0], [3, 0, 0, 0, 0], [4, 4, 4, 4, 5]]
    assert lengths.tolist() == [4, 1, 5]  # capacity 5: the 6 is dropped
