"""What the ranks of a tensor-parallel group must agree on (seed: *Confidence*; ACC-14,
ACC-15, ACC-16).

A group completion carries rank zero's outputs and, under ``PEER_OUTPUTS_KEY``, each
other rank's. The completion-validator checks rank zero's as on one rank; this module
holds the cross-rank rules:

- ``disagreement``: exact request identities (state rows), consumption (accepted,
  verified, target rows, proposed drafts, applied state lanes) and emitted prefixes
  (token ids, drafted ids) must be equal on every rank (ACC-16); a frame whose ranks
  disagree is rejected as a whole, since which rank is right is unknowable;
- ``peer_confidence_problem``: each peer's confidence estimates for a lane's slot must
  be probabilities (finite, in [0, 1] up to rounding), but need not equal rank zero's
  bitwise (ACC-15); a malformed one fails that lane;
- everything the host decides from (forecasts, survival, logprobs) is rank zero's:
  peers' values are checked, never used (ACC-14).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gpu import (
    PEER_OUTPUTS_KEY,
    SpeculativeMixedResult,
    SpeculativeResult,
    StepResult,
)

__all__ = ["disagreement", "peer_confidence_problem", "peer_results"]


def peer_results(outputs: Mapping[str, Any], read: Callable[[Mapping[str, Any]], object]
                 ) -> tuple[object, ...]:
    """Each peer rank's result, read from its outputs as rank zero's were (``read``)."""
    return tuple(read(peer) for peer in outputs.get(PEER_OUTPUTS_KEY, ()))


def _round_identity(result: SpeculativeResult) -> tuple[object, ...]:
    return tuple((lane.row, lane.tokens, lane.accepted, lane.evaluated, lane.target_rows,
                  lane.proposed, lane.drafts) for lane in result.lanes)


def _identity(result: object) -> object:
    """What must agree exactly across ranks, of one rank's result."""
    if isinstance(result, StepResult):
        return tuple((s.row, s.token) for s in result.samples)
    if isinstance(result, SpeculativeResult):
        return _round_identity(result)
    if isinstance(result, SpeculativeMixedResult):
        sample = result.prompt_sample
        return (_round_identity(result.speculative),
                None if sample is None else (sample.row, sample.token))
    return getattr(result, "lanes", result)  # a state operation: the lanes it applied


def disagreement(primary: object, peers: tuple[object, ...]) -> str | None:
    """Why the peers' results do not agree with rank zero's (ACC-16), or None."""
    expected = _identity(primary)
    for rank, peer in enumerate(peers, start=1):
        if type(peer) is not type(primary):
            return f"rank {rank} returned {type(peer).__name__}, rank 0 {type(primary).__name__}"
        if _identity(peer) != expected:
            return (f"rank {rank} disagrees with rank 0 on request identities, consumption "
                    "or emitted tokens")
    return None


def _confidence(result: object) -> np.ndarray | None:
    if isinstance(result, SpeculativeMixedResult):
        result = result.speculative
    if isinstance(result, SpeculativeResult):
        return np.asarray(result.confidence)
    return None


def peer_confidence_problem(peers: tuple[object, ...], slot: int,
                            problem_of: Callable[[np.ndarray, int], str | None]
                            ) -> str | None:
    """A peer's malformed confidence estimate for ``slot`` (ACC-15), or None;
    ``problem_of`` is the validator's own check of one rank's sidecar slot."""
    for rank, peer in enumerate(peers, start=1):
        confidence = _confidence(peer)
        problem = None if confidence is None else problem_of(confidence, slot)
        if problem is not None:
            return f"rank {rank}'s {problem}"
    return None
