"""Baseline policies run behind the same planner, on the same prepared programs
(``--scheduler-policy fcfs|sarathi|vtc``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actors.public import Finished, StreamEvent, TokenDelta
from actors.system import Runtime
from policy.baselines.factory import make_policy
from tests.actors.toy import reference_output, request, toy_runtime


async def _collect(rt: Runtime, req: object) -> list[StreamEvent]:
    async with rt.generate(req) as events:  # type: ignore[arg-type]
        return [event async for event in events]


@pytest.mark.parametrize("policy", ["balanced", "throughput", "fcfs", "sarathi", "vtc"])
async def test_every_policy_serves_concurrent_requests_exactly(
        policy: str, autojump_clock: trio.testing.MockClock) -> None:
    prompts = [[(i * 7 + j) % 31 + 1 for j in range(3 + 4 * i)] for i in range(5)]
    results: dict[int, list[StreamEvent]] = {}
    async with toy_runtime(state_rows=4, max_queue=8, timed=True,
                           scheduler_policy=policy) as toy:

        async def one(i: int) -> None:
            results[i] = await _collect(toy.runtime, request(prompts[i], 5 + i))

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        # The runtime's planner drives exactly the policy the flag names.
        assert type(toy.runtime.scheduler) is type(make_policy(policy))
    for i, prompt in enumerate(prompts):
        tokens = [t for e in results[i] if isinstance(e, TokenDelta) for t in e.token_ids]
        assert tokens == reference_output(prompt, 5 + i)
        final = results[i][-1]
        assert isinstance(final, Finished) and final.reason == "length"
