"""``n`` choices on the real runtime and the embedded default model, through the official
``openai`` client: the prompt is prefilled once (the siblings start from its pages),
each sibling samples with its own seed stream (different, and reproducible), greedy
siblings agree.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import openai
import pytest
import trio
from scheduler_client import OpenRuntime
from test_openai_real_runtime import served

pytestmark = pytest.mark.slow
PROMPT = ("import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
          "        return [line.rstrip() for line in f]\n\n\ndef main():\n")
PAGE_SIZE = 16  # RuntimeConfig's default


async def test_n_siblings_share_the_prefill_and_own_their_seeds(
        real_open_runtime: OpenRuntime) -> None:
    with trio.fail_after(300):
        async with served(real_open_runtime) as (server, runtime):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            create = partial(client.completions.create, model=runtime.model_name,
                             prompt=PROMPT, max_tokens=10, n=3,
                             extra_body={"ignore_eos": True})

            def run() -> tuple[Any, ...]:
                before = runtime.statistics().prefix_cache_hit_tokens
                sampled = create(temperature=1.0, seed=7)
                hits = runtime.statistics().prefix_cache_hit_tokens - before
                again = create(temperature=1.0, seed=7)
                greedy = create(temperature=0.0)
                return sampled, hits, again, greedy

            sampled, hits, again, greedy = await trio.to_thread.run_sync(run)
            client.close()
            prompt_tokens = len(runtime.codec.encode(PROMPT))
    shareable = (prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE
    assert shareable > 0
    assert hits == 2 * shareable  # the first sibling prefilled; the other two reused it
    assert sampled.usage.prompt_tokens == prompt_tokens  # counted once
    assert sampled.usage.completion_tokens == 30
    texts = [c.text for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # each sibling its own seed stream
    assert [c.text for c in again.choices] == texts  # and reproducible
    assert len({c.text for c in greedy.choices}) == 1
