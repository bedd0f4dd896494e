"""OpenAI ``logprobs`` objects, from the runtime's per-token logprobs and alternatives.

Completions use the legacy shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
``{token text: logprob}`` dict per token, ``null`` for the first echoed prompt token,
which nothing predicts; the whole list ``null`` when ``logprobs`` is 0) and
``text_offset``. As in vLLM and OpenAI, a token's dict holds its k most likely
alternatives and the token itself, so it may have k + 1 entries. Chat uses
``content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`` with
exactly k alternatives, best first. A token the sampler could never draw (a
``--logprobs-mode processed_logprobs`` alternative that top-k, top-p or min-p removed)
has logprob ``-inf``, which JSON cannot carry: it is sent as ``MASKED_LOGPROB``
(-9999.0, vLLM's value). Pure functions over plain values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from actors import Alternatives, TextCodec

MASKED_LOGPROB = -9999.0
"""The logprob sent for a token of probability zero (vLLM's; JSON has no ``-inf``)."""


def json_logprob(logprob: float) -> float:
    """``logprob`` as sent: ``MASKED_LOGPROB`` instead of ``-inf``, any other value
    unchanged."""
    return MASKED_LOGPROB if logprob == float("-inf") else logprob


def top_logprobs_dict(codec: TextCodec, alternatives: Alternatives, token_id: int,
                      logprob: float | None) -> dict[str, float]:
    """The legacy ``{token text: logprob}`` dict of one place: its alternatives best
    first, then the token itself when it is not among them (two ids with the same text
    keep the likelier one's logprob)."""
    entries: dict[str, float] = {}
    for alt_id, alt_logprob in alternatives:
        entries.setdefault(codec.decode([alt_id]), json_logprob(alt_logprob))
    if logprob is not None and all(alt_id != token_id for alt_id, _ in alternatives):
        entries.setdefault(codec.decode([token_id]), json_logprob(logprob))
    return entries


@dataclass(slots=True)
class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, built incrementally.

    ``text_offset`` counts characters from the start of the returned text (which
    includes the prompt under ``echo``). ``top`` is the request's ``logprobs`` k.
    """

    codec: TextCodec
    top: int = 0
    next_offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float | None],
            alternatives: Sequence[Alternatives] = ()) -> dict[str, Any]:
        """Append tokens; return the ``logprobs`` object for just these tokens."""
        chunk_tokens = [self.codec.decode([t]) for t in token_ids]
        chunk_offsets = []
        for text in chunk_tokens:
            chunk_offsets.append(self.next_offset)
            self.next_offset += len(text)
        chunk_logprobs = list(logprobs) + [None] * (len(chunk_tokens) - len(logprobs))
        chunk_top: list[dict[str, float] | None] = []
        if self.top > 0:
            for index, (token_id, logprob) in enumerate(zip(token_ids, chunk_logprobs,
                                                            strict=True)):
                alts = alternatives[index] if index < len(alternatives) else ()
                chunk_top.append(None if logprob is None else
                                 top_logprobs_dict(self.codec, alts, token_id, logprob))
        self.tokens.extend(chunk_tokens)
        self.token_logprobs.extend(chunk_logprobs)
        self.top_logprobs.extend(chunk_top)
        self.text_offset.extend(chunk_offsets)
        return {"tokens": chunk_tokens, "token_logprobs": chunk_logprobs,
                "top_logprobs": chunk_top if self.top > 0 else None,
                "text_offset": chunk_offsets}

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs if self.top > 0 else None,
                "text_offset": self.text_offset}


def _chat_token(codec: TextCodec, token_id: int, logprob: float) -> dict[str, Any]:
    text = codec.decode([token_id])
    return {"token": text, "logprob": json_logprob(logprob),
            "bytes": list(text.encode("utf-8"))}


def chat_logprob_entries(codec: TextCodec, token_ids: Sequence[int], logprobs: Sequence[float],
                         alternatives: Sequence[Alternatives] = ()) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` entries for these tokens, each with its alternatives."""
    entries = []
    for index, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        alts = alternatives[index] if index < len(alternatives) else ()
        entries.append({**_chat_token(codec, token_id, logprob),
                        "top_logprobs": [_chat_token(codec, i, lp) for i, lp in alts]})
    return entries
