"""Parse the logit-processing sampling fields of a request body (pure: no I/O).

OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``, and vLLM's
extra fields ``repetition_penalty``, ``min_p``, ``min_tokens`` and ``stop_token_ids``,
on completions and chat alike. Each malformed value is a 400 naming its field; the
ranges are vLLM's. What needs the vocabulary (token ids inside it) or the resolved
``max_tokens`` (``min_tokens`` at most that) is checked by the service, which knows them.
"""

from __future__ import annotations

import math
from typing import Any

from actors import MAX_LOGIT_BIAS_ENTRIES
from app.errors import bad_request

MAX_STOP_TOKEN_IDS = 256
"""Most ``stop_token_ids`` one request may name (each is checked on every output token)."""

MAX_PENALTY = 2.0
"""OpenAI's bound on ``|presence_penalty|`` and ``|frequency_penalty|``."""

MAX_BIAS = 100.0
"""OpenAI's bound on ``|logit_bias|`` values."""


def parse_sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The logit-processing keyword arguments of ``SamplingParams`` in ``body`` (absent
    or null fields: their neutral defaults)."""
    return {
        "presence_penalty": _number(body, "presence_penalty", -MAX_PENALTY, MAX_PENALTY, 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY,
                                     0.0),
        "repetition_penalty": _repetition_penalty(body),
        "min_p": _number(body, "min_p", 0.0, 1.0, 0.0),
        "logit_bias": _logit_bias(body.get("logit_bias")),
        "min_tokens": _min_tokens(body.get("min_tokens")),
        "stop_token_ids": _stop_token_ids(body.get("stop_token_ids")),
    }


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{name}' must be a number.", param=name)
    try:
        return float(value)
    except OverflowError:  # an integer literal too large for a float
        return math.inf


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    number = _float(name, value)
    if not lo <= number <= hi:  # NaN fails too
        raise bad_request(f"'{name}' must be within [{lo}, {hi}], got {value}.", param=name)
    return number


def _repetition_penalty(body: dict[str, Any]) -> float:
    value = body.get("repetition_penalty")
    if value is None:
        return 1.0
    number = _float("repetition_penalty", value)
    if not (math.isfinite(number) and number > 0):
        raise bad_request(f"'repetition_penalty' must be a finite number > 0 (1 is off), got "
                          f"{value}.", param="repetition_penalty")
    return number


def _token_id(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"'{name}' token ids must be non-negative integers, got "
                          f"{str(value)[:40]}.", param=name)
    return value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    name = "logit_bias"
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases.",
                          param=name)
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"'logit_bias' holds at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                          f"{len(value)}.", param=name)
    entries: dict[int, float] = {}
    for key, bias in value.items():
        text = key.strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 12:
            raise bad_request(f"'logit_bias' keys must be token ids (non-negative integers), "
                              f"got {key[:40]!r}.", param=name)
        token = int(text)
        number = _float(name, bias)
        if not -MAX_BIAS <= number <= MAX_BIAS:
            raise bad_request(f"'logit_bias' values must be within [-{MAX_BIAS}, {MAX_BIAS}], "
                              f"got {bias} for token {token}.", param=name)
        if token in entries:
            raise bad_request(f"'logit_bias' names token {token} twice.", param=name)
        entries[token] = number
    return tuple(sorted(entries.items()))


def _min_tokens(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise bad_request(f"'min_tokens' must be an integer >= 0, got {str(value)[:40]}.",
                          param="min_tokens")
    return value


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    name = "stop_token_ids"
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("'stop_token_ids' must be a list of token ids.", param=name)
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' holds at most {MAX_STOP_TOKEN_IDS} ids.",
                          param=name)
    return tuple(dict.fromkeys(_token_id(name, t) for t in value))
