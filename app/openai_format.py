"""OpenAI response and stream-chunk bodies (pure functions over plain values).

Completions use ``object: text_completion``; chat uses ``chat.completion`` and
``chat.completion.chunk``. Streams end with ``data: [DONE]``; an error after the stream
has started is sent as one ``data: {"error": {...}}`` event before ``[DONE]`` (the
``openai`` client raises it as an ``APIError``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from actors import Finished

OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseHead:
    """The fields every body and chunk of one response repeats."""

    request_id: str
    created: int
    model: str

    def fields(self, object_name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model}


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache; ``None`` (not known yet, as in a
    ``continuous_usage_stats`` chunk) leaves ``prompt_tokens_details`` out."""


def usage_body(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def finish_reason(finished: Finished) -> str:
    return OPENAI_FINISH_REASONS.get(finished.reason, finished.reason)


def completion_choice(index: int, *, text: str, logprobs: dict[str, Any] | None,
                      finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_choice(index: int, *, text: str, logprobs: list[dict[str, Any]] | None,
                finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason}


def completion_body(head: ResponseHead, *, choices: list[dict[str, Any]],
                    usage: Usage) -> dict[str, Any]:
    """``choices`` sorted by index."""
    return {**head.fields("text_completion"), "choices": choices,
            "usage": usage_body(usage)}


def chat_body(head: ResponseHead, *, choices: list[dict[str, Any]],
              usage: Usage) -> dict[str, Any]:
    return {**head.fields("chat.completion"), "choices": choices, "usage": usage_body(usage)}


def completion_chunk(head: ResponseHead, *, index: int = 0, text: str,
                     logprobs: dict[str, Any] | None = None,
                     finish_reason: str | None = None) -> dict[str, Any]:
    return {
        **head.fields("text_completion"),
        "choices": [completion_choice(index, text=text, logprobs=logprobs,
                                      finish_reason=finish_reason)],
    }


def chat_chunk(head: ResponseHead, *, index: int = 0, delta: dict[str, Any],
               logprobs: list[dict[str, Any]] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
    return {
        **head.fields("chat.completion.chunk"),
        "choices": [{
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason,
        }],
    }


def usage_chunk(head: ResponseHead, *, object_name: str, usage: Usage) -> dict[str, Any]:
    return {**head.fields(object_name), "choices": [], "usage": usage_body(usage)}
