"""Test helper: a request placed directly in the decode phase (prompt done, one output
committed, last visible a few milliseconds ago), optionally with preseeded acceptance."""

from __future__ import annotations

from collections.abc import Sequence

from policy import Phase, RequestHandle, Scheduler

MS = 1_000_000


def decoding(s: Scheduler, *, means: Sequence[float] | None = None, weight: float = 64.0,
             prompt_len: int = 64, max_output_tokens: int = 500,
             visible_ago_ns: int = 5 * MS) -> RequestHandle:
    h = s.admit(prompt_len=prompt_len, max_output_tokens=max_output_tokens)
    rec = s.request(h)
    rec.phase = Phase.DECODE
    rec.prompt_cursor = prompt_len
    rec.output_committed = 1
    rec.last_visible_ns = s.now_ns - visible_ago_ns
    if means is not None:  # a scheduler that plans speculative rounds
        s.preseed_acceptance(h, means, weight=weight)  # type: ignore[attr-defined]
    return h
