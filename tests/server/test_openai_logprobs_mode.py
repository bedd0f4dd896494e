"""``--logprobs-mode`` through the official ``openai`` client on the real runtime and the
embedded default model.

Under ``processed_logprobs`` a sampled request with ``top_k: 5`` reports the
distribution its tokens were drawn from: at most 5 alternatives per token have a real
logprob, their probabilities sum to 1, the sampled token is among them, and every other
alternative is sent as -9999.0 (JSON has no ``-inf``). Under ``raw_logprobs`` (the
default) the same request reports the model's unfiltered distribution: all alternatives
real, their mass under 1.
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
import trio
from scheduler_client import OpenRuntime

from actors.config import RuntimeConfig
from ops.testing import serve_app

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
TOP_K = 5
WIDTH = 10
MASKED = -9999.0


async def chat_and_completion(open_runtime: OpenRuntime, mode: str) -> tuple[Any, Any]:
    config = RuntimeConfig(max_batch=4, prefill_capacities=(64, 256), logprobs_mode=mode)  # type: ignore[arg-type]
    with trio.fail_after(300):
        async with open_runtime(config) as runtime, serve_app(runtime) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            common = dict(model=runtime.model_name, max_tokens=8, temperature=0.8, seed=7,
                          extra_body={"top_k": TOP_K, "ignore_eos": True})

            def run() -> tuple[Any, Any]:
                chat = client.chat.completions.create(  # type: ignore[call-overload]
                    messages=MESSAGES, logprobs=True, top_logprobs=WIDTH, **common)
                completion = client.completions.create(  # type: ignore[call-overload]
                    prompt="def add(a, b):\n    return", logprobs=WIDTH, **common)
                return chat, completion

            chat, completion = await trio.to_thread.run_sync(run)
            client.close()
    return chat, completion


async def test_processed_logprobs_are_the_top_k_distribution(
        real_open_runtime: OpenRuntime) -> None:
    chat, completion = await chat_and_completion(real_open_runtime, "processed_logprobs")
    content = chat.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == WIDTH
        kept = [v for v in values if v > MASKED]
        assert 1 <= len(kept) <= TOP_K
        assert all(v == MASKED for v in values[len(kept):])
        assert sum(math.exp(v) for v in kept) == pytest.approx(1.0, abs=1e-3)
        tokens = {t.token: t.logprob for t in entry.top_logprobs[:len(kept)]}
        assert tokens[entry.token] == pytest.approx(entry.logprob, abs=1e-6)
    lp = completion.choices[0].logprobs
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        kept = [v for v in top.values() if v > MASKED]
        assert 1 <= len(kept) <= TOP_K and logprob in kept
        assert sum(math.exp(v) for v in kept) == pytest.approx(1.0, abs=1e-3)


async def test_raw_logprobs_are_the_unfiltered_distribution(
        real_open_runtime: OpenRuntime) -> None:
    chat, completion = await chat_and_completion(real_open_runtime, "raw_logprobs")
    for entry in chat.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == WIDTH and all(v > MASKED for v in values)
        assert sum(math.exp(v) for v in values) < 1.0
    for top in completion.choices[0].logprobs.top_logprobs:
        assert len(top) >= WIDTH and all(v > MASKED for v in top.values())
