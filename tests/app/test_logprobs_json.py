"""Logprobs of probability-zero tokens (``--logprobs-mode processed_logprobs``
alternatives the filters removed, ``-inf`` on the device) are sent as -9999.0, vLLM's
value, so every body is strict JSON; other values pass through unchanged."""

from __future__ import annotations

import json

from http_fakes import TinyCodec

from app.logprobs_format import CompletionLogprobs, chat_logprob_entries

NEG_INF = float("-inf")
ALTERNATIVES = ((5, -0.1), (6, -2.4), (7, NEG_INF), (8, NEG_INF))


def test_chat_entries_send_minus_infinity_as_the_masked_value(codec: TinyCodec) -> None:
    entries = chat_logprob_entries(codec, [5], [-0.1], [ALTERNATIVES])
    values = [t["logprob"] for t in entries[0]["top_logprobs"]]
    assert values == [-0.1, -2.4, -9999.0, -9999.0]
    json.dumps(entries, allow_nan=False)  # strict JSON: no -Infinity


def test_completion_dicts_send_minus_infinity_as_the_masked_value(codec: TinyCodec) -> None:
    logprobs = CompletionLogprobs(codec, top=4)
    chunk = logprobs.add([5], [-0.1], [ALTERNATIVES])
    (top,) = chunk["top_logprobs"]
    assert sorted(top.values(), reverse=True) == [-0.1, -2.4, -9999.0, -9999.0][:len(top)]
    assert -9999.0 in top.values() and chunk["token_logprobs"] == [-0.1]
    json.dumps(logprobs.body(), allow_nan=False)
