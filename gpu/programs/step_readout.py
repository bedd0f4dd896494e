"""A step program's outputs as host arrays, and the ``StepResult`` built from them on
the reader's thread (off the stream)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpu.frames import LaneSample, StepResult


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReadout:
    """A step program's outputs as host arrays (sampled lanes only, lane order); the
    ``StepResult`` is built by ``result()`` on the reader's thread (``result_of``)."""

    rows: tuple[int, ...]
    tokens: np.ndarray
    logprobs: np.ndarray
    finite: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt_logprobs: np.ndarray | None = None
    prompt_top_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None
    draft_proposals: np.ndarray | None = None
    """Per sampled lane, the learned draft's greedy proposal (``LaneSample``)."""
    draft_acceptances: np.ndarray | None = None
    """Per sampled lane, a depth-one draft's acceptance probability (``LaneSample``)."""

    def result(self) -> StepResult:
        tokens, logprobs, finite = (self.tokens.tolist(), self.logprobs.tolist(),
                                    self.finite.tolist())
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        proposals = (self.draft_proposals.tolist() if self.draft_proposals is not None
                     else [-1] * len(self.rows))
        acceptances = (self.draft_acceptances.tolist() if self.draft_acceptances is not None
                       else [-1.0] * len(self.rows))
        samples = tuple(
            LaneSample(row=row, token=tokens[i], logprob=logprobs[i], finite=finite[i],
                       top_logprobs=tuple(zip(top_ids[i], top_lps[i], strict=True)),
                       draft_proposal=proposals[i], draft_acceptance=acceptances[i])
            for i, row in enumerate(self.rows))
        if self.prompt_logprobs is None:
            return StepResult(samples=samples)
        assert self.prompt_top_ids is not None and self.prompt_top_logprobs is not None
        prompt_ids, prompt_lps = self.prompt_top_ids.tolist(), self.prompt_top_logprobs.tolist()
        return StepResult(
            samples=samples,
            prompt_logprobs=tuple(self.prompt_logprobs.tolist()),
            prompt_top_logprobs=tuple(tuple(zip(ids, lps, strict=True))
                                      for ids, lps in zip(prompt_ids, prompt_lps, strict=True)),
        )
