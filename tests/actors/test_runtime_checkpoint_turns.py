"""A second chat turn on the embedded default model reuses the first turn's terminal
state, on the real CPU backend through ``open_runtime``. Covers PRE-37..39, PRE-53,
OPEN-35, QUEUE-16..17.

Turn two's prompt is turn one's prompt, its answer (the generated ids, ``<|end|>``
included) and a new user message, sent the moment turn one's ``Finished`` arrives, so
every position turn one wrote is reusable: the prefix cache must supply all of them
(full pages shared, the partial tail taken),
turn two must run only its new tokens, and its greedy output must equal the output
without any cache (the same prompt scored, which bypasses the cache, and
transformers' own greedy continuation).
"""

from __future__ import annotations

import pytest
import trio

from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
from actors.public import Finished, GenerationRequest, SamplingParams
from actors.system import Runtime, open_runtime
from gpu.model.tokenizer import Tokenizer
from tests.actors.reference import hf_greedy
from tests.actors.toy import collect, wait_until_idle

GREEDY = SamplingParams(temperature=0.0)
SYSTEM = "You are a helpful assistant."
FIRST = "Write one sentence about the sea."
SECOND = "Now one about the mountains."


async def run_turn(rt: Runtime, prompt: list[int], max_tokens: int, *,
                   message_ends: tuple[int, ...] = (), bypass_cache: bool = False
                   ) -> tuple[list[int], Finished]:
    return await collect(rt, GenerationRequest(
        prompt_token_ids=tuple(prompt), max_tokens=max_tokens, sampling=GREEDY,
        message_ends=message_ends, prompt_logprobs=bypass_cache))


def state_frames(rt: Runtime) -> int:
    return sum(n for graph, n in rt.statistics().executions_by_graph
               if graph.startswith("state"))


@pytest.mark.slow
@pytest.mark.parametrize("state_operations", [False, True], ids=["host-tail", "capture"])
async def test_second_turn_reuses_the_terminal_state(state_operations: bool) -> None:
    tokenizer = Tokenizer.load(DEFAULT_MODEL_DIR)
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, backend="cpu", max_batch=2,
                           prefill_capacities=(64,), page_size=16, max_context=512,
                           state_operations=state_operations)
    with trio.fail_after(120):
        async with open_runtime(config) as rt:
            system = rt.codec.encode(tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
            turn_one = rt.codec.encode(tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]))
            answer, first = await run_turn(rt, turn_one, 40, message_ends=(len(system),))
            assert first.reason in ("stop", "length") and len(answer) >= 8
            suffix = rt.codec.encode(f"\n<|user|>\n{SECOND}<|end|>\n<|assistant|>\n")
            turn_two = [*turn_one, *answer, *suffix]
            written = len(turn_one) + len(answer) - 1  # the last token's KV is never written
            before = rt.statistics().prompt_tokens_total
            reply, second = await run_turn(rt, turn_two, 24, message_ends=(
                len(system), len(turn_one) + len(answer)))
            ran = rt.statistics().prompt_tokens_total - before
            await wait_until_idle(rt)
            captures = state_frames(rt)
            uncached, _ = await run_turn(rt, turn_two, 24, bypass_cache=True)
    assert second.cached_prompt_tokens == written
    assert ran == len(turn_two) - written
    assert reply == uncached
    assert reply == hf_greedy(DEFAULT_MODEL_DIR, turn_two, len(reply))
    # With state operations turn one's terminal capture ran (its decode time pays for
    # it, QUEUE-23) and the published tail turn two took is the capture's copy (turn
    # two's own capture may run too); without, the host moved the request's own tail.
    assert (captures >= 1) if state_operations else captures == 0
