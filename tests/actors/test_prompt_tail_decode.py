"""A request whose uncached prompt is one token feeds it to its first decode step
(``RuntimeConfig.decode_prompt_tail``, ``policy.lifecycle.decodes_prompt_tail``): a
prompt found whole in the prefix cache, or a one-token prompt, runs no prompt chunk,
and its output is the same as with the seed's prefill. A prompt whose last page is
cached with a previous request's later tokens in it gets a private copy of that page
(``PrefixCache.lookup(copy_last_page=True)``, ``gpu.frames.PageCopy``), so any prompt
found whole leaves exactly one token."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing

from actors.config import RuntimeConfig
from actors.frame_inputs import admitted_source, decodes_last_token, kv_extent, pack_frame
from actors.messages import Grant, PagePlan, StateRow
from actors.public import GenerationRequest, SamplingParams, TokenDelta
from actors.system import Runtime, open_runtime
from gpu.frames import ImageSpan, PageAppend, PageCopy, RowInit
from policy import GraphKind, GraphShape, Lane, LaneRole, RequestHandle, ScheduledPlan
from policy.types import ScheduledStep, SelectionReason
from tests.actors.reference import hf_greedy
from tests.actors.toy import collect, reference_output, request, toy_runtime, wait_until_idle

GREEDY = SamplingParams(temperature=0.0)


def _prompt_frames(rt: Runtime, after_fence: int) -> list[str]:
    """The graphs of frames after ``after_fence`` that carried prompt work."""
    return [f.graph for f in rt.frame_log()
            if int(f.fence) > after_fence and not f.graph.startswith("decode")]


def _last_fence(rt: Runtime) -> int:
    log = rt.frame_log()
    return int(log[-1].fence) if log else 0


@pytest.mark.parametrize("decode_prompt_tail", [True, False], ids=["tail", "seed"])
@pytest.mark.parametrize("length", [29, 30, 32], ids=["one-past-a-page", "mid-page", "full-page"])
async def test_a_prompt_found_whole_in_the_cache_runs_no_prompt_chunk(
        autojump_clock: trio.testing.MockClock, decode_prompt_tail: bool, length: int) -> None:
    """Page size 4: 28 of 29 tokens are full cached pages; 30 and 32 end inside a page
    the first request filled with its outputs, which the repeat copies."""
    prompt = [1 + (i * 7) % 36 for i in range(length)]
    async with toy_runtime(decode_prompt_tail=decode_prompt_tail, mixed=True) as toy:
        rt = toy.runtime
        first, _ = await collect(rt, request(prompt, 8, ignore_eos=True))
        await wait_until_idle(rt)
        ran, fence = toy.device.prompt_tokens_run, _last_fence(rt)
        again, final = await collect(rt, request(prompt, 8, ignore_eos=True))
        assert first == again == reference_output(prompt, 8, ignore_eos=True)
        if decode_prompt_tail:
            assert final.cached_prompt_tokens == length - 1
            assert toy.device.prompt_tokens_run == ran
            assert _prompt_frames(rt, fence) == []
            assert toy.device.page_copies == (0 if (length - 1) % 4 == 0 else 1)
        else:
            assert final.cached_prompt_tokens == (length - 1) // 4 * 4
            assert toy.device.prompt_tokens_run == ran + length - final.cached_prompt_tokens
            assert len(_prompt_frames(rt, fence)) == 1 and toy.device.page_copies == 0
        await wait_until_idle(rt)
        assert rt.resources.statistics().pages_free + rt.resources.statistics().pages_cached \
            == rt.resources.statistics().pages_total


async def test_a_cached_prompt_joins_running_decoders_in_their_decode_frame(
        autojump_clock: trio.testing.MockClock) -> None:
    """Three requests decode; a fourth, found whole in the cache, rides their next
    decode frame: no frame of its own, no mixed frame, and nobody's output changes."""
    prompts = [[7 + i, 3, 5, 11, 2 + i, 9, 4, 6, 8] for i in range(4)]  # 8 of 9 cached
    async with toy_runtime(mixed=True, max_batch=4, timed=True, scheduler_policy="fcfs") as toy:
        rt = toy.runtime
        cached, _ = await collect(rt, request(prompts[0], 4, ignore_eos=True))
        await wait_until_idle(rt)
        outputs: dict[int, list[int]] = {}
        decoding = trio.Event()

        async def long_one(i: int) -> None:
            async with rt.generate(request(prompts[i], 40, ignore_eos=True)) as events:
                async for event in events:
                    if isinstance(event, TokenDelta):
                        outputs.setdefault(i, []).extend(event.token_ids)
                        if all(len(outputs.get(k, ())) >= 3 for k in (1, 2, 3)):
                            decoding.set()

        async with trio.open_nursery() as nursery:
            for i in (1, 2, 3):
                nursery.start_soon(long_one, i)
            await decoding.wait()
            fence = _last_fence(rt)
            again, final = await collect(rt, request(prompts[0], 4, ignore_eos=True))
            joined = [f.lanes for f in rt.frame_log() if int(f.fence) > fence]
        assert again == cached == reference_output(prompts[0], 4, ignore_eos=True)
        assert final.cached_prompt_tokens == len(prompts[0]) - 1
        assert _prompt_frames(rt, fence) == []
        assert max(joined) == 4  # the repeat decoded beside the three
        assert all(outputs[i] == reference_output(prompts[i], 40, ignore_eos=True)
                   for i in (1, 2, 3))


async def test_a_one_token_prompt_decodes_from_the_start(
        autojump_clock: trio.testing.MockClock) -> None:
    async with toy_runtime() as toy:
        tokens, final = await collect(toy.runtime, request([17], 6))
        assert tokens == reference_output([17], 6)
        assert final.cached_prompt_tokens == 0 and toy.device.prompt_tokens_run == 0


def test_scored_prompts_and_images_keep_their_prefill() -> None:
    prompt = tuple(range(1, 11))
    assert decodes_last_token(GenerationRequest(prompt_token_ids=prompt, max_tokens=1), 9)
    assert not decodes_last_token(GenerationRequest(prompt_token_ids=prompt, max_tokens=1), 8)
    assert not decodes_last_token(
        GenerationRequest(prompt_token_ids=prompt, max_tokens=1, prompt_logprobs=True), 9)
    image = ImageSpan(digest="d", image=None, start=2, tokens=4)
    assert not decodes_last_token(
        GenerationRequest(prompt_token_ids=prompt, max_tokens=1, images=(image,)), 9)


def test_the_first_decode_feeds_the_last_prompt_token_at_its_position() -> None:
    """The packed frame copies the granted page, initialises the row with the last
    prompt token pending at position ``len(prompt) - 1`` and reserves KV through
    ``len(prompt)`` only."""
    prompt = (5, 6, 7, 8, 9)
    handle = RequestHandle(3)
    grant = Grant(handle=handle, epoch=0, row=StateRow(1), cached_pages=(11, 12),
                  cached_tokens=4, page_copy=(30, 12))
    source = admitted_source(
        GenerationRequest(prompt_token_ids=prompt, max_tokens=4, sampling=GREEDY), grant,
        epoch=0, eos_token_ids=(), grammar=None, decodes_prompt_tail=True)
    lane = Lane(handle=handle, epoch=0, role=LaneRole.DECODE, token_ceiling=1)
    assert kv_extent(lane, source) == len(prompt)
    shape = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1,
                       packed_capacity=1)
    plan = ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=(lane,)), estimated_duration_ns=1_000,
        scaled_score=1.0, scale_exponent=0, duration_known=True, stale=False,
        reason=SelectionReason.ORDINARY, requires_empty_window=False, planned_at_ns=0,
        start_ns=0, useful_value=1.0)
    frame, _ = pack_frame(plan, {handle: source}, (
        PagePlan(handle=handle, row=StateRow(1), first_block=1, page_ids=()),))
    copy, init, append = frame.updates
    assert isinstance(copy, PageCopy) and (copy.src_page, copy.dst_page) == (30, 12)
    assert isinstance(init, RowInit) and (init.position, init.pending_token) == (4, 9)
    assert isinstance(append, PageAppend) and append.page_ids == (11, 12)
    plain = admitted_source(
        GenerationRequest(prompt_token_ids=prompt, max_tokens=4, sampling=GREEDY),
        replace(grant, page_copy=None), epoch=0, eos_token_ids=(), grammar=None)
    assert kv_extent(lane, plain) == len(prompt) + 1


@pytest.mark.slow
@pytest.mark.parametrize("decode_prompt_tail", [True, False])
async def test_real_model_output_is_unchanged_when_the_last_prompt_token_decodes(
        tiny_llama: Path, decode_prompt_tail: bool) -> None:
    """The tiny Llama on the cpu backend: a prompt repeated whole, a one-token prompt
    and a repeated prompt beside a running decoder all equal transformers' greedy
    output, and the repeats run no prompt token unless the setting is off."""
    long_prompt = [3 + (i * 37) % 90 for i in range(40)]  # its last page is copied
    other = [5 + (i * 11) % 80 for i in range(20)]
    config = RuntimeConfig(model_dir=tiny_llama, backend="cpu", max_batch=4,
                           prefill_capacities=(64,), page_size=16, max_context=256,
                           mixed_prefill=True, decode_prompt_tail=decode_prompt_tail)

    def greedy(prompt: list[int], n: int) -> GenerationRequest:
        return GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=n,
                                 sampling=GREEDY, ignore_eos=True)

    with trio.fail_after(120):
        async with open_runtime(config) as rt:
            first, _ = await collect(rt, greedy(long_prompt, 10))
            assert first == hf_greedy(tiny_llama, long_prompt, 10)
            await wait_until_idle(rt)
            before = rt.statistics().prompt_tokens_total
            again, final = await collect(rt, greedy(long_prompt, 10))
            assert again == first
            ran = rt.statistics().prompt_tokens_total - before
            if decode_prompt_tail:  # the last page is copied: one token left, decoded
                assert final.cached_prompt_tokens == len(long_prompt) - 1 and ran == 0
            else:  # two full pages shared, eight tokens prefilled
                assert final.cached_prompt_tokens == 32 and ran == 8

            one, _ = await collect(rt, greedy([42], 6))
            assert one == hf_greedy(tiny_llama, [42], 6)

            results: dict[str, list[int]] = {}

            async def run(name: str, req: GenerationRequest) -> None:
                results[name], _ = await collect(rt, req)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "other", greedy(other, 24))
                nursery.start_soon(run, "repeat", greedy(long_prompt, 10))
            assert results["repeat"] == first
            assert results["other"] == hf_greedy(tiny_llama, other, 24)


@pytest.mark.slow
async def test_a_repeated_prompt_speculates_from_its_last_token(tiny_llama: Path) -> None:
    """Fixed speculation with the target's own weights as the draft: the repeat's first
    round starts at the last prompt token, and every draft is accepted only if the
    cached pages carry the draft's KV and the draft absorbed that token (SPEC-5)."""
    prompt = [3 + (i * 29) % 90 for i in range(40)]
    config = RuntimeConfig(model_dir=tiny_llama, backend="cpu", max_batch=4,
                           prefill_capacities=(64,), page_size=16, max_context=256,
                           speculation="fixed", draft_source="draft",
                           draft_model_dir=tiny_llama, draft_depth=3)
    req = GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=16, sampling=GREEDY,
                            ignore_eos=True)
    with trio.fail_after(120):
        async with open_runtime(config) as rt:
            first, _ = await collect(rt, req)
            await wait_until_idle(rt)
            before = rt.statistics()
            again, final = await collect(rt, req)
            after = rt.statistics()
    assert first == again == hf_greedy(tiny_llama, prompt, 16)
    assert final.cached_prompt_tokens == len(prompt) - 1
    assert after.prompt_tokens_total == before.prompt_tokens_total
    drafted = after.speculative_drafted_tokens - before.speculative_drafted_tokens
    accepted = after.speculative_accepted_tokens - before.speculative_accepted_tokens
    assert drafted > 0 and accepted == drafted
