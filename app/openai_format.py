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


def usage_body(finished: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_prompt_tokens},
    }


def completion_body(head: ResponseHead, *, text: str,
                    logprobs: dict[str, Any] | None, finished: Finished) -> dict[str, Any]:
    return {
        **head.fields("text_completion"),
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": OPENAI_FINISH_REASONS.get(finished.reason, finished.reason),
        }],
        "usage": usage_body(finished),
    }


def completion_chunk(head: ResponseHead, *, text: str,
                     logprobs: dict[str, Any] | None = None,
                     finish_reason: str | None = None) -> dict[str, Any]:
    return {
        **head.fields("text_completion"),
        "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }


def chat_body(head: ResponseHead, *, text: str,
              logprobs: list[dict[str, Any]] | None, finished: Finished) -> dict[str, Any]:
    return {
        **head.fields("chat.completion"),
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": OPENAI_FINISH_REASONS.get(finished.reason, finished.reason),
        }],
        "usage": usage_body(finished),
    }


def chat_chunk(head: ResponseHead, *, delta: dict[str, Any],
               logprobs: list[dict[str, Any]] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
    return {
        **head.fields("chat.completion.chunk"),
        "choices": [{
            "index": 0,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason,
        }],
    }


def usage_chunk(head: ResponseHead, *, object_name: str,
                finished: Finished) -> dict[str, Any]:
    return {**head.fields(object_name), "choices": [], "usage": usage_body(finished)}
