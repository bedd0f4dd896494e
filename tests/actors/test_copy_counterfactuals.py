"""Counterfactual copy rounds (``actors.copy_counterfactuals``): the host's incremental
replay of the copy lookup equals the programs' lookup, and a counterfactual round is
decided the way a verified copy round would be (ACC-6, ACC-7), censored at the
request's end (ACC-8); no match offers nothing (ACC-9)."""

from __future__ import annotations

import random

import pytest
import torch

from actors.copy_counterfactuals import CopyCounterfactuals
from gpu.speculative.copy_proposals import COPY_MAX_NGRAM, propose_copy, reference_copy_proposal


@pytest.mark.parametrize("seed", range(6))
def test_incremental_lookup_equals_the_reference_and_the_device_lookup(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice((3, 5, 12))
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
    tracker = CopyCounterfactuals.starting_from(prompt, depth=4, max_ngram=COPY_MAX_NGRAM)
    context = list(prompt)
    for _ in range(60):
        expected = reference_copy_proposal(context, depth=4, max_ngram=COPY_MAX_NGRAM)
        assert list(tracker.proposal()) == expected
        device = propose_copy(torch.tensor([context + [0] * 4]), torch.tensor([len(context)]),
                              depth=4, max_ngram=COPY_MAX_NGRAM)
        count = int(device.proposed[0])
        assert device.tokens[0, :count].tolist() == expected
        token = rng.randrange(vocab)
        tracker.extend([token])
        context.append(token)


def test_acc_6_7_a_counterfactual_round_is_decided_at_its_first_mismatch() -> None:
    # the last 2-gram (5, 6) occurred earlier, followed by 7, 5, 6
    tracker = CopyCounterfactuals.starting_from([5, 6, 7, 5, 6], depth=3, max_ngram=3)
    assert tracker.proposal() == (7, 5, 6)
    tracker.open_round()
    assert tracker.extend([7]) == []  # one draft matched, two undecided
    assert tracker.extend([5, 9]) == [(3, 2)]  # the third draft was rejected
    assert tracker.undecided == 0


def test_acc_6_every_draft_matching_decides_the_round_at_once() -> None:
    tracker = CopyCounterfactuals.starting_from([1, 2, 3, 1, 2], depth=2, max_ngram=3)
    tracker.open_round()  # proposes (3, 1)
    assert tracker.extend([3, 1, 4]) == [(2, 2)]


def test_rounds_opened_on_consecutive_frames_are_decided_independently() -> None:
    tracker = CopyCounterfactuals.starting_from([1, 2, 3, 1, 2], depth=3, max_ngram=3)
    tracker.open_round()  # (3, 1, 2)
    assert tracker.extend([3]) == []
    tracker.open_round()  # context ends 1 2 3: its earlier occurrence is followed by 1, 2, 3
    assert tracker.proposal() == (1, 2, 3)
    assert tracker.extend([1]) == []
    assert tracker.extend([7]) == [(3, 2), (3, 1)]


def test_acc_8_the_end_of_the_request_censors_undecided_rounds() -> None:
    tracker = CopyCounterfactuals.starting_from([5, 6, 7, 5, 6], depth=3, max_ngram=3)
    tracker.open_round()
    assert tracker.extend([7]) == []
    assert tracker.terminate() == [(3, 1)]
    assert tracker.undecided == 0


def test_acc_9_no_match_opens_no_round() -> None:
    tracker = CopyCounterfactuals.starting_from([1, 2, 3, 4], depth=3, max_ngram=3)
    assert tracker.proposal() == ()
    tracker.open_round()
    assert tracker.undecided == 0
    assert tracker.extend([9, 9]) == []


def test_the_proposal_never_runs_past_the_context() -> None:
    # the match ends right before the last token: only one token follows it
    tracker = CopyCounterfactuals.starting_from([8, 8], depth=4, max_ngram=3)
    assert tracker.proposal() == (8,)


@pytest.mark.parametrize(("depth", "max_ngram", "min_ngram"), [(0, 3, 1), (2, 0, 1), (2, 2, 3)])
def test_bad_settings_are_refused(depth: int, max_ngram: int, min_ngram: int) -> None:
    with pytest.raises(ValueError):
        CopyCounterfactuals.starting_from([1], depth=depth, max_ngram=max_ngram,
                                          min_ngram=min_ngram)
