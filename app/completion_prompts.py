"""The ``prompt`` of ``POST /v1/completions``: one prompt or a batch (pure).

As OpenAI and vLLM read it: a string, a list of token ids (one prompt), a list of
strings, or a list of token-id lists (a batch; each entry is one prompt and gets its
own ``n`` choices, indices ``prompt_index * n + i``). Mixed batches, empty batches and
empty token lists are refused naming ``prompt``.
"""

from __future__ import annotations

from typing import Any

from app.errors import bad_request

Prompt = str | tuple[int, ...]


def _token_ids(value: list[Any]) -> tuple[int, ...] | None:
    if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            raise bad_request("Token ids in 'prompt' must be non-negative.", param="prompt")
        return tuple(value)
    return None


def parse_prompts(raw: Any) -> tuple[Prompt, ...]:
    """Every prompt ``raw`` holds, in order (at least one)."""
    if isinstance(raw, str):
        return (raw,)
    if not isinstance(raw, list) or not raw:
        raise bad_request("'prompt' is required: a string, a list of token ids, or a "
                          "non-empty list of strings or of token-id lists.", param="prompt")
    ids = _token_ids(raw)
    if ids is not None:
        return (ids,)
    if all(isinstance(p, str) for p in raw):
        return tuple(raw)
    if all(isinstance(p, list) for p in raw):
        batch = tuple(_token_ids(p) for p in raw)
        if all(p is not None for p in batch):
            return tuple(p for p in batch if p is not None)
    raise bad_request("'prompt' must be a string, a list of token ids, or a list of "
                      "strings or of (non-empty) token-id lists, not a mix.", param="prompt")
