"""What a speculative round takes and gives back: ``SpeculativeFrame`` (the host's
rows and limits), ``SpeculativeLane`` and ``SpeculativeResult`` (what each lane
produced), their mixed counterparts (``SpeculativeMixedFrame``: a prompt chunk beside
the decode lanes; ``SpeculativeMixedResult``), and ``SpeculativeReadout``, the output
buffers' host copies from which ``speculative_result_of`` builds the result off the
stream. Host values only: importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.frames import NO_PROMPT_ROW, RESULT_KEY, LaneSample, StateUpdate


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeFrame:
    """One speculative round for ``rows`` (lane ``i`` is ``rows[i]``).

    ``limits[i]`` is, for a ``QueryLength`` program, the lane's exact target rows
    (1..W: the pending token plus ``limits[i] - 1`` verified drafts; their sum fits P);
    for a ``SpeculativePrefixLimit`` program, the lane's immutable ceiling
    ``min(D + 1, W, request limit)`` (1..W; the sum may exceed P). The host reserves
    pages for positions ``position .. position + limits[i] - 1`` (in ``updates``)."""

    rows: tuple[int, ...]
    limits: tuple[int, ...]
    updates: tuple[StateUpdate, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeLane:
    """What one lane produced: ``tokens`` (accepted drafts then the correction or bonus
    token), their logprobs and top alternatives, whether the target rows were finite,
    the accepted and verified draft counts, the target rows it used, the drafts the
    source supplied (copy: the proposal length; learned: D), the survival products
    of its verified prefixes (ACC-27) and the drafted tokens themselves."""

    row: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    finite: bool
    accepted: int
    evaluated: int
    target_rows: int
    proposed: int
    survival: tuple[float, ...]
    drafts: tuple[int, ...] = ()
    """The proposal the round drew (``proposed`` tokens; none for idle lanes)."""
    draft_proposal: int = -1
    """Width-one learned rounds that keep the draft context: the draft's greedy
    proposal for the emitted token (``LaneSample.draft_proposal``); -1 otherwise."""
    draft_acceptance: float = -1.0
    """Such a round's sampled lanes: ``sum min(p, q)`` for the emitted token
    (``LaneSample.draft_acceptance``); -1 otherwise."""
    beyond: float = -1.0
    """Learned rounds with ``D >= 1``, lanes that verified all ``D`` drafts: the
    probability that the draft's next proposal would have been accepted at the target's
    row ``D`` along the drafted prefix (greedy: whether it equals the target's argmax
    there; sampled: ``sum min(p, q)`` over that row); -1 for other lanes. Reported
    whatever the lane accepted, so that observing depth ``D + 1`` does not depend on the
    outcome (the prefix's own survival multiplies it: ``policy.learning.round_observations``)."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SpeculativeResult:
    """Result of a speculative round: one entry per frame lane, and the sidecars over
    all B slots: ``confidence float32 [2, B, D]`` and ``survival float32 [B, D]``
    (``completion_speculative_survival``)."""

    lanes: tuple[SpeculativeLane, ...]
    confidence: np.ndarray
    survival: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeMixedFrame:
    """``rows`` (lane ``i`` is ``rows[i]``) with the prompt lane at ``prefill_row``
    (-1: none). ``limits[i]`` is a decode lane's query length (1..W) and 0 for the
    prompt lane; the decode lanes' lengths sum to at most ``(B - 1) * W``. The prompt
    chunk ``prompt_tokens`` starts at ``prompt_start``; ``prompt_ends`` samples the
    request's first output token."""

    rows: tuple[int, ...]
    limits: tuple[int, ...]
    prefill_row: int = NO_PROMPT_ROW
    prompt_tokens: tuple[int, ...] = ()
    prompt_start: int = 0
    prompt_ends: bool = False
    updates: tuple[StateUpdate, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SpeculativeMixedResult:
    """The decode lanes' round and, when the chunk ended its prompt, the prompt lane's
    first token."""

    speculative: SpeculativeResult
    prompt_sample: LaneSample | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeReadout:
    """A round's output buffers as host arrays; ``result()`` builds the
    ``SpeculativeResult`` on the reader's thread (``speculative_result_of``), so the
    stream's worker only copies."""

    rows: tuple[int, ...]
    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    finite: np.ndarray
    counts: np.ndarray
    """``[4, lanes]``: accepted, evaluated, target rows, proposed."""
    survival: np.ndarray
    drafts: np.ndarray
    confidence: np.ndarray
    proposals: np.ndarray | None = None
    """Width-one learned rounds: the draft's greedy proposal per slot (-1: none)."""
    acceptances: np.ndarray | None = None
    """Width-one learned rounds with a sampled lane: ``sum min(p, q)`` per slot (-1:
    none)."""
    beyond: np.ndarray | None = None
    """Learned rounds with ``D >= 1``: the depth-``(D + 1)`` counterfactual per slot
    (-1: none)."""

    def result(self) -> SpeculativeResult:
        accepted, evaluated, target_rows, proposed = self.counts.tolist()
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        finite, survival, drafts = (self.finite.tolist(), self.survival.tolist(),
                                    self.drafts.tolist())
        proposals = (self.proposals.tolist() if self.proposals is not None
                     else [-1] * len(self.rows))
        acceptances = (self.acceptances.tolist() if self.acceptances is not None
                       else [-1.0] * len(self.rows))
        beyond = self.beyond.tolist() if self.beyond is not None else [-1.0] * len(self.rows)
        lanes = []
        for i, row in enumerate(self.rows):
            count = accepted[i] + 1
            lanes.append(SpeculativeLane(
                row=row, tokens=tuple(tokens[i][:count]), logprobs=tuple(logprobs[i][:count]),
                top_logprobs=tuple(tuple(zip(top_ids[i][k], top_lps[i][k], strict=True))
                                   for k in range(count)),
                finite=bool(finite[i]), accepted=accepted[i], evaluated=evaluated[i],
                target_rows=target_rows[i], proposed=proposed[i],
                survival=tuple(survival[i][:evaluated[i]]),
                drafts=tuple(drafts[i][:proposed[i]]), draft_proposal=proposals[i],
                draft_acceptance=acceptances[i], beyond=beyond[i],
            ))
        return SpeculativeResult(lanes=tuple(lanes), confidence=self.confidence,
                                 survival=self.survival)


def speculative_result_of(outputs: Mapping[str, Any]) -> Any:
    """The result inside a speculative program's ``read_outputs`` mapping, built here
    from its ``SpeculativeReadout`` (anything else is returned as it is, for the
    validator to reject)."""
    result = outputs.get(RESULT_KEY)
    return result.result() if isinstance(result, SpeculativeReadout) else result
