"""completion-validator bounds on speculative lanes: every token id and drafted token in
``[0, vocab)``, every survival product and confidence estimate a probability in
``[0, 1]``. A lane that breaks a bound fails alone; the frame's other lane is
accepted. Covers ACCT-6, SPEC-19, ACC-15, ACC-27, ACC-28."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from actors.completion_validator import FrameCheck, check_frame
from gpu.backends.protocol import Completion
from gpu.frames import RESULT_KEY
from gpu.programs.speculative_frames import SpeculativeLane, SpeculativeResult
from policy.types import RequestHandle
from tests.actors.test_speculative_validation import SPEC, TIMING, lane, order, outcome

VOCAB = 50


def good(row: int, **changes: object) -> SpeculativeLane:
    """Three tokens (two accepted drafts, both supplied) and their survival products."""
    fields: dict[str, object] = {"drafts": (7, 8), "survival": (0.75, 0.5), **changes}
    return dataclasses.replace(lane(row, (7, 8, 9)), **fields)  # type: ignore[arg-type]


def check(second: SpeculativeLane, confidence: np.ndarray | None = None) -> FrameCheck:
    """Lane 0 well formed, lane 1 ``second``."""
    o = order()
    lanes = (good(4), second)
    out = outcome(o, lanes)
    if confidence is not None:
        result = SpeculativeResult(lanes=lanes, confidence=confidence,
                                   survival=np.zeros((2, 2), np.float32))
        out = dataclasses.replace(out, completion=Completion(
            shape=SPEC, outputs={RESULT_KEY: result}, timing=TIMING))
    return check_frame(o, out, vocab_size=VOCAB)


def only_lane_one_fails(result: FrameCheck, word: str) -> None:
    assert [r.ok for r in result.records] == [True, False]
    assert len(result.failures) == 1 and result.failures[0].handle == RequestHandle(1)
    assert word in result.failures[0].message
    assert result.records[0].token_ids == (7, 8, 9)
    assert result.rounds is not None and len(result.rounds.lanes) == 1


@pytest.mark.parametrize("tokens", [(7, 8, VOCAB), (VOCAB, 8, 9), (7, -1, 9)])
def test_token_id_at_the_vocabulary_size_fails_only_its_lane(tokens: tuple[int, ...]) -> None:
    only_lane_one_fails(check(good(5, tokens=tokens)), "vocabulary")


def test_token_id_below_the_vocabulary_size_passes() -> None:
    result = check(good(5, tokens=(7, 8, VOCAB - 1)))
    assert all(r.ok for r in result.records) and result.failures == ()


def test_drafted_token_at_the_vocabulary_size_fails_only_its_lane() -> None:
    only_lane_one_fails(check(good(5, drafts=(7, VOCAB))), "vocabulary")


@pytest.mark.parametrize("value", [1.2, math.nan, -0.1, math.inf])
def test_survival_outside_zero_one_fails_only_its_lane(value: float) -> None:
    only_lane_one_fails(check(good(5, survival=(0.5, value))), "survival")


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_survival_at_the_bounds_passes(value: float) -> None:
    assert all(r.ok for r in check(good(5, survival=(value, value))).records)


def test_survival_within_rounding_of_one_is_clamped() -> None:
    result = check(good(5, survival=(1.00005, 0.5)))
    assert all(r.ok for r in result.records)
    assert result.rounds is not None and result.rounds.lanes[1].survival == (1.0, 0.5)


@pytest.mark.parametrize("value", [1.2, math.nan, -0.5])
@pytest.mark.parametrize("plane", [0, 1])
def test_confidence_outside_zero_one_fails_only_its_lane(plane: int, value: float) -> None:
    """ACC-15: a confidence estimate must be a probability; slot 1 is lane 1's."""
    confidence = np.full((2, 2, 2), 0.25, np.float32)
    confidence[plane, 1, 1] = value
    only_lane_one_fails(check(good(5), confidence), "confidence")
    assert check(good(5), np.full((2, 2, 2), 1.0, np.float32)).failures == ()
