"""``RuntimeStatistics`` counts prefix-cache queries and hits in tokens (vLLM's
``prefix_cache_queries`` / ``prefix_cache_hits``): every admitted prompt is a query
except a scored one (``prompt_logprobs`` skips the lookup), and the hits are the cached
tokens its grant reused; ``preemptions`` stays 0 (OPEN-3: nothing is ever preempted)."""

from __future__ import annotations

import trio
import trio.testing

from actors.public import Finished, TokenDelta
from actors.system import Runtime
from tests.actors.toy import request, toy_runtime


async def serve(rt: Runtime, prompt: list[int], max_tokens: int, **kw: object
                ) -> tuple[list[int], Finished]:
    tokens: list[int] = []
    async with rt.generate(request(prompt, max_tokens, **kw)) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
            elif isinstance(event, Finished):
                return tokens, event
    raise AssertionError("no Finished")


async def test_open_3_queries_hits_and_no_preemptions(
        autojump_clock: trio.testing.MockClock) -> None:
    turn_one = list(range(1, 15))
    async with toy_runtime() as toy:
        output, _ = await serve(toy.runtime, turn_one, 9)
        turn_two = [*turn_one, *output, 30, 31, 32]
        _, second = await serve(toy.runtime, turn_two, 3)
        stats = toy.runtime.statistics()
    assert second.cached_prompt_tokens > 0
    assert stats.prefix_cache_query_tokens == len(turn_one) + len(turn_two)
    assert stats.prefix_cache_hit_tokens == second.cached_prompt_tokens
    assert stats.preemptions == 0


async def test_a_scored_prompt_queries_nothing(flare_runtime: Runtime) -> None:
    """On the real runtime (the toy programs return no prompt scores)."""
    prompt = flare_runtime.codec.encode("def add(a, b):\n    return a + b\n")
    with trio.fail_after(30):
        await serve(flare_runtime, prompt, 2)
        await serve(flare_runtime, prompt, 1, prompt_logprobs=True)
    assert flare_runtime.statistics().prefix_cache_query_tokens == len(prompt)
