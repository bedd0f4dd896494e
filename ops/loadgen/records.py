"""What one benchmarked request looked like: a frozen record the metrics read and JSON holds.

Times are seconds on the client's monotonic clock, measured from the start of the run
(``sent_s`` is when the request left, each entry of ``chunk_times_s`` is when a streamed
chunk that carried output text arrived). ``chunk_tokens`` is how many output tokens each of
those chunks carried: the local tokenizer's count of the chunk's text, rescaled so that the
chunks sum to the server's ``usage.completion_tokens`` when the server reports it (so a
server that sends several tokens per chunk, e.g. after speculative verification, is counted
right in total and approximately per chunk).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any, Literal

RequestStatus = Literal["ok", "error", "cancelled"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """One request's outcome and streamed-chunk timeline."""

    index: int
    client: str
    scheduled_s: float
    sent_s: float
    status: RequestStatus
    target_prompt_tokens: int
    target_output_tokens: int
    prompt_tokens: int
    chunk_times_s: tuple[float, ...] = ()
    chunk_tokens: tuple[float, ...] = ()
    finished_s: float | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if len(self.chunk_times_s) != len(self.chunk_tokens):
            raise ValueError("chunk_times_s and chunk_tokens differ in length")

    @property
    def output_tokens(self) -> float:
        """Output tokens delivered (sum over chunks)."""
        return float(sum(self.chunk_tokens))

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: first text-bearing chunk minus send time."""
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: end of the stream minus send time (ok requests only)."""
        if self.status != "ok" or self.finished_s is None:
            return None
        return self.finished_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last chunk - first chunk) / (tokens - 1).

        ``None`` for requests with at most one output token, or that did not finish.
        """
        if self.status != "ok" or len(self.chunk_times_s) == 0 or self.output_tokens <= 1:
            return None
        span = self.chunk_times_s[-1] - self.chunk_times_s[0]
        return span / (self.output_tokens - 1)

    def chunk_gaps_s(self) -> tuple[float, ...]:
        """Gaps between consecutive text-bearing chunks (one fewer than chunks)."""
        times = self.chunk_times_s
        return tuple(b - a for a, b in itertools.pairwise(times))

    def to_json(self) -> dict[str, Any]:
        # Field by field: ``dataclasses.asdict`` deep-copies every chunk time, which
        # made writing a 2,000-request run file take seconds.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["chunk_times_s"] = list(self.chunk_times_s)
        data["chunk_tokens"] = list(self.chunk_tokens)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        values = dict(data)
        values["chunk_times_s"] = tuple(float(t) for t in values.get("chunk_times_s", ()))
        values["chunk_tokens"] = tuple(float(t) for t in values.get("chunk_tokens", ()))
        return cls(**values)


def rescale_chunk_tokens(counts: list[int], reported_total: int | None) -> tuple[float, ...]:
    """Per-chunk token counts, rescaled to sum to ``reported_total`` when the server gave one.

    Chunks the local count saw as empty-of-tokens (but which carried text) get one token
    before rescaling, so every text-bearing chunk carries a positive share.
    """
    base = [max(c, 1) for c in counts]
    if reported_total is None or reported_total <= 0 or not base:
        return tuple(float(c) for c in base)
    total = sum(base)
    return tuple(c * reported_total / total for c in base)
