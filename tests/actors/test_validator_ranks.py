"""completion-validator on a tensor-parallel group's completion: rank zero's outputs
plus each peer's (``PEER_OUTPUTS_KEY``). Covers ACC-14 (rank zero's confidence drives
the host: a different rank-1 confidence leaves the round's forecast input unchanged),
ACC-15 (a peer's estimate must be a probability, not bitwise rank zero's: 1.2 or NaN
fails its lane, a slightly different valid value passes) and ACC-16 (ranks that
disagree on an emitted prefix, on consumption or on a sampled token reject the
completion)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from actors.completion_validator import FrameCheck, check_frame
from gpu.backends.protocol import Completion
from gpu.frames import PEER_OUTPUTS_KEY, RESULT_KEY, StepResult
from gpu.programs.speculative_frames import SpeculativeLane, SpeculativeResult
from policy.types import RequestHandle
from tests.actors.test_completion_validator import good as decode_good
from tests.actors.test_completion_validator import order as decode_order
from tests.actors.test_completion_validator import outcome as decode_outcome
from tests.actors.test_speculative_validation import SPEC, TIMING, order, outcome
from tests.actors.test_validator_bounds import VOCAB, good

CONFIDENCE = np.full((2, 2, 2), 0.25, np.float32)


def round_of(lanes: tuple[SpeculativeLane, ...], confidence: np.ndarray = CONFIDENCE
             ) -> SpeculativeResult:
    return SpeculativeResult(lanes=lanes, confidence=confidence,
                             survival=np.zeros((2, 2), np.float32))


def check_group(peer: SpeculativeResult) -> FrameCheck:
    """Rank zero: two well-formed lanes; rank one: ``peer``."""
    o = order()
    out = outcome(o, (good(4), good(5)))
    outputs = {RESULT_KEY: round_of((good(4), good(5))),
               PEER_OUTPUTS_KEY: ({RESULT_KEY: peer},)}
    return check_frame(o, dataclasses.replace(out, completion=Completion(
        shape=SPEC, outputs=outputs, timing=TIMING)), vocab_size=VOCAB)


def test_agreeing_ranks_pass_with_rank_zeros_confidence() -> None:
    """ACC-14, ACC-15: a peer whose estimates differ slightly (still probabilities)
    passes, and the round carries rank zero's confidence, not the peer's."""
    peer = CONFIDENCE.copy()
    peer[0, 1, 1] = 0.2500001
    peer[1, 0, 0] = 0.9
    result = check_group(round_of((good(4), good(5)), peer))
    assert all(r.ok for r in result.records) and result.failures == ()
    assert result.rounds is not None
    assert np.array_equal(np.asarray(result.rounds.confidence), CONFIDENCE)


@pytest.mark.parametrize("value", [1.2, math.nan])
def test_malformed_peer_confidence_fails_its_lane(value: float) -> None:
    """ACC-15: the peer's slot-1 estimate is no probability: lane 1 fails alone."""
    peer = CONFIDENCE.copy()
    peer[1, 1, 0] = value
    result = check_group(round_of((good(4), good(5)), peer))
    assert [r.ok for r in result.records] == [True, False]
    assert result.failures[0].handle == RequestHandle(1)
    assert "rank 1" in result.failures[0].message
    assert "confidence" in result.failures[0].message


@pytest.mark.parametrize("changes", [{"tokens": (7, 8, 10)}, {"accepted": 1, "tokens": (7, 9)},
                                     {"drafts": (7, 6)}, {"row": 6}],
                         ids=["emitted-prefix", "consumption", "drafts", "identity"])
def test_ranks_disagreeing_reject_the_completion(changes: dict[str, object]) -> None:
    """ACC-16: every lane fails, naming the disagreement."""
    peer = dataclasses.replace(good(5), **changes)  # type: ignore[arg-type]
    result = check_group(round_of((good(4), peer)))
    assert [r.ok for r in result.records] == [False, False]
    assert all("ranks disagree" in f.message for f in result.failures)


def test_ranks_disagreeing_on_a_sampled_token_reject_a_decode() -> None:
    """ACC-16 on an ordinary step: the peer sampled another token for lane 1."""
    o = decode_order()
    out = decode_outcome(o, (decode_good(10), decode_good(11)))
    assert out.completion is not None
    rank_zero = out.completion.outputs[RESULT_KEY]

    def with_peer(peer: StepResult) -> FrameCheck:
        outputs = {RESULT_KEY: rank_zero, PEER_OUTPUTS_KEY: ({RESULT_KEY: peer},)}
        return check_frame(o, dataclasses.replace(out, completion=dataclasses.replace(
            out.completion, outputs=outputs)), vocab_size=VOCAB)

    other = StepResult(samples=(decode_good(10), decode_good(11, token=6)))
    assert [r.ok for r in with_peer(other).records] == [False, False]
    assert [r.ok for r in with_peer(rank_zero).records] == [True, True]
