"""The runtime on the real CPU backend with a tiny random Llama: greedy outputs equal
transformers' reference, a second conversation turn hits the prefix cache, and many
concurrent requests with random cancellations return every page and state row.
Covers VER-28 (end to end), QUEUE-9, PRE-53, PRE-54, OPEN-35."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from actors.config import RuntimeConfig
from actors.public import (
    Finished,
    GenerationRequest,
    PromptScores,
    SamplingParams,
)
from actors.system import Runtime, open_runtime
from tests.actors.reference import hf_greedy, hf_prompt_logprobs
from tests.actors.toy import collect, wait_until_idle

GREEDY = SamplingParams(temperature=0.0)


def config_for(model_dir: Path, **kw: object) -> RuntimeConfig:
    args: dict[str, object] = dict(model_dir=model_dir, backend="cpu", max_batch=4,
                                   prefill_capacities=(64,), page_size=16, max_context=256)
    args.update(kw)
    return RuntimeConfig(**args)  # type: ignore[arg-type]


async def generate(rt: Runtime, prompt: list[int], max_tokens: int) -> tuple[list[int], Finished]:
    return await collect(rt, GenerationRequest(prompt_token_ids=tuple(prompt),
                                               max_tokens=max_tokens, sampling=GREEDY,
                                               ignore_eos=True))


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 96) for _ in range(length)]


@pytest.mark.slow
@pytest.mark.parametrize("state_operations", [False, True], ids=["host-tail", "snapshot"])
async def test_greedy_outputs_equal_reference_and_second_turn_hits_cache(
        tiny_llama: Path, state_operations: bool) -> None:
    """With ``state_operations`` every completion its checkpoint allowance pays for
    ends with a real SNAPSHOT program whose partial-page copy the second turn takes
    (PRE-37..39, PRE-53, QUEUE-23)."""
    prompts = [prompt_of(n, seed) for seed, n in enumerate((5, 23, 40, 70))]
    references = [hf_greedy(tiny_llama, p, 12) for p in prompts]
    with trio.fail_after(120):
        async with open_runtime(config_for(tiny_llama,
                                           state_operations=state_operations)) as rt:
            results: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                results[i], _ = await generate(rt, prompts[i], 12)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            assert [results[i] for i in range(len(prompts))] == references

            turn_one = prompts[3]
            turn_two = [*turn_one, *references[3], 7, 8, 9]
            before = rt.statistics().prompt_tokens_total
            tokens, final = await generate(rt, turn_two, 8)
            ran = rt.statistics().prompt_tokens_total - before
            assert final.cached_prompt_tokens == 81  # five full pages and a 1-token tail
            assert ran == len(turn_two) - 81
            assert tokens == hf_greedy(tiny_llama, turn_two, 8)

            # Scored prefill: prompt log-probabilities equal transformers' (OPEN-39).
            scored = GenerationRequest(prompt_token_ids=tuple(prompts[2]), max_tokens=1,
                                       sampling=GREEDY, prompt_logprobs=True)
            async with rt.generate(scored) as events:
                scores = [e async for e in events if isinstance(e, PromptScores)]
            assert len(scores) == 1 and scores[0].logprobs[0] is None
            reference = hf_prompt_logprobs(tiny_llama, prompts[2])
            assert scores[0].logprobs[1:] == pytest.approx(reference, abs=1e-3)
            await wait_until_idle(rt)
            snapshots = sum(n for kind, n in rt.statistics().executions_by_graph
                            if kind.startswith("state"))
            # Five completions earn their capture from their decodes (QUEUE-23). The
            # scored one-token request has only its prefill's allowance (5 % of its
            # measured time): whether that covers the measured snapshot depends on
            # this machine's timings of the two programs, so it may add a sixth. The
            # decode allowance of a 12-token completion on this tiny model is itself
            # within the spread of the snapshot's measured cost on a loaded machine,
            # so one of the five may fall short.
            if state_operations:
                assert 4 <= snapshots <= 6
            else:
                assert snapshots == 0


@pytest.mark.slow
@pytest.mark.parametrize("state_operations", [False, True], ids=["host-tail", "snapshot"])
async def test_random_cancellations_return_every_page_and_row(tiny_llama: Path,
                                                              state_operations: bool) -> None:
    rng = random.Random(5)
    with trio.fail_after(120):
        async with open_runtime(config_for(tiny_llama, max_queue=32,
                                           state_operations=state_operations)) as rt:

            async def client(i: int) -> None:
                request = GenerationRequest(
                    prompt_token_ids=tuple(prompt_of(rng.randrange(3, 90), 100 + i)),
                    max_tokens=rng.randrange(1, 24),
                    sampling=SamplingParams(temperature=0.8, seed=i))
                cancel_after = rng.randrange(0, 6)
                with trio.move_on_after(rng.random() * 0.05):
                    async with rt.generate(request) as events:
                        seen = 0
                        async for _ in events:
                            seen += 1
                            if seen > cancel_after:
                                break

            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(client, i)
                    await trio.sleep(rng.random() * 0.01)
            await wait_until_idle(rt)
            stats = rt.resources.statistics()
            assert stats.rows_free == stats.rows_total
            assert stats.pages_total - stats.pages_free == stats.pages_cached
            assert rt.statistics().requests_waiting == 0
            assert rt.scheduler.statistics().resident == 0


@pytest.mark.slow
async def test_queue_17_next_turn_keeping_the_anchor_but_not_the_answer_hits(
        tiny_llama: Path) -> None:
    """Covers QUEUE-16, QUEUE-17, OPEN-3: turn one's last completed message ends at
    token 37, inside its partial last page; a second turn that keeps those 37 tokens
    but not the answer (a regenerated reply) reuses them all: two full pages shared
    and the tail taken truncated to the anchor. Its greedy output equals
    transformers'."""
    turn_one = prompt_of(40, 31)
    turn_two = [*turn_one[:37], *[(t % 90) + 4 for t in turn_one[37:40]], 11, 12, 13]
    assert turn_two[37] != turn_one[37]
    with trio.fail_after(120):
        async with open_runtime(config_for(tiny_llama)) as rt:
            first = GenerationRequest(prompt_token_ids=tuple(turn_one), max_tokens=5,
                                      sampling=GREEDY, ignore_eos=True, message_ends=(12, 37))
            async with rt.generate(first) as events:
                async for _ in events:
                    pass
            before = rt.statistics().prompt_tokens_total
            tokens, final = await generate(rt, turn_two, 6)
            ran = rt.statistics().prompt_tokens_total - before
            await wait_until_idle(rt)
    assert final.cached_prompt_tokens == 37
    assert ran == len(turn_two) - 37
    assert tokens == hf_greedy(tiny_llama, turn_two, 6)


@pytest.mark.slow
async def test_forwards_are_captured_before_serving(tiny_llama: Path) -> None:
    """With forward capture (the runtime's CPU default) ``open_runtime`` launches every
    generation program once before serving, so requests of any context length trace no
    graph mid-load (``actors.capture_warmup``); their greedy output is the reference.
    Graphs are counted per process, so the stream runs in this one."""
    from gpu.model import capture

    prompts = [prompt_of(n, seed) for seed, n in enumerate((5, 70))]
    with trio.fail_after(120):
        async with open_runtime(config_for(tiny_llama, device_process=False)) as rt:
            graphs = capture.shared_graphs()
            assert graphs > 0
            for prompt in prompts:
                tokens, _ = await generate(rt, prompt, 12)
                assert tokens == hf_greedy(tiny_llama, prompt, 12)
            assert capture.shared_graphs() == graphs
