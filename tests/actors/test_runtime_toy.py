"""Runtime phase tests on the fake backend and trio's autojump clock (VER-28): worker
completion, publication, stop buffering, input packing; two-slot queueing (QUEUE-10,
QUEUE-11); cancellation at every stage (QUEUE-8, QUEUE-9, PRE-54); slot reuse (ACCT-5);
malformed completions (ACCT-6); program faults; admission limits; prefix reuse
across conversation turns (PRE-53, OPEN-35)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio
import trio.testing

from actors.errors import ContextTooLong, InvalidRequest, QueueFull, RuntimeShutDown
from actors.public import Finished, StreamEvent, TokenDelta
from actors.system import Runtime
from policy.descriptors import GraphKind
from tests.actors.toy import (
    EOS_MAGIC,
    VOCAB,
    ToyCodec,
    ToySystem,
    reference_output,
    request,
    toy_runtime,
    until,
    wait_until_idle,
)

Clock = trio.testing.MockClock


async def collect(rt: Runtime, req: Any) -> list[StreamEvent]:
    async with rt.generate(req) as events:
        return [event async for event in events]


def tokens_of(events: list[StreamEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]


def text_of(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenDelta))


def finished(events: list[StreamEvent]) -> Finished:
    final = events[-1]
    assert isinstance(final, Finished)
    return final


async def assert_all_returned(toy: ToySystem) -> None:
    """Every row is free and the only used pages are the prefix cache's."""
    await wait_until_idle(toy.runtime)
    stats = toy.runtime.resources.statistics()
    assert stats.residents == 0
    assert stats.rows_free == stats.rows_total
    assert stats.pages_total - stats.pages_free == stats.pages_cached


async def test_ver_28_worker_completion_and_publication(autojump_clock: Clock) -> None:
    """Covers VER-28 (worker completion, publication, input packing)."""
    prompt = list(range(1, 11))
    async with toy_runtime() as toy:
        events = await collect(toy.runtime, request(prompt, 9))
        await assert_all_returned(toy)
    expected = reference_output(prompt, 9)
    assert tokens_of(events) == expected
    assert text_of(events) == ToyCodec().decode(expected)
    final = finished(events)
    assert (final.reason, final.prompt_tokens, final.completion_tokens) == ("length", 10, 9)


async def test_ver_28_input_packing_long_prompt_in_chunks(autojump_clock: Clock) -> None:
    """A prompt longer than the largest prefill runs in chunks at the right positions."""
    prompt = [(i * 7) % 30 for i in range(150)]
    async with toy_runtime(num_pages=128, prefill=(64,)) as toy:
        events = await collect(toy.runtime, request(prompt, 5))
        assert toy.device.prompt_tokens_run == 150
    assert tokens_of(events) == reference_output(prompt, 5)


async def test_eos_finishes_with_stop(autojump_clock: Clock) -> None:
    prompt = [EOS_MAGIC, 1, 2, 3, 4]
    async with toy_runtime() as toy:
        events = await collect(toy.runtime, request(prompt, 20))
        await assert_all_returned(toy)
    expected = reference_output(prompt, 20)
    final = finished(events)
    assert final.reason == "stop" and final.completion_tokens == len(expected) == 8
    assert tokens_of(events) == expected[:-1]  # EOS is not shown


async def test_ver_28_stop_buffering(autojump_clock: Clock) -> None:
    """Covers VER-28 (stop buffering), ACCT-16: text stops before the stop string."""
    prompt = list(range(3, 13))
    text = ToyCodec().decode(reference_output(prompt, 12))
    stop = text[5:8]
    async with toy_runtime() as toy:
        events = await collect(toy.runtime, request(prompt, 12, stop=(stop,)))
        await wait_until_idle(toy.runtime)
        await assert_all_returned(toy)
    assert text_of(events) == text[: text.index(stop)]
    final = finished(events)
    assert final.reason == "stop" and final.completion_tokens == 8


async def test_concurrent_requests_all_match_reference(autojump_clock: Clock) -> None:
    prompts = [[(i * 5 + j) % 37 for j in range(4 + 3 * i)] for i in range(7)]
    results: dict[int, list[StreamEvent]] = {}
    async with toy_runtime(state_rows=4, max_queue=8, timed=True) as toy:

        async def one(i: int) -> None:
            results[i] = await collect(toy.runtime, request(prompts[i], 6 + i))

        book = toy.runtime.resources
        grant = book.acquire
        most_resident = 0

        def acquire(*args: Any, **kwargs: Any) -> Any:
            nonlocal most_resident
            granted = grant(*args, **kwargs)
            most_resident = max(most_resident, book.statistics().residents)
            return granted

        book.acquire = acquire  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        await assert_all_returned(toy)
    for i, prompt in enumerate(prompts):
        assert tokens_of(results[i]) == reference_output(prompt, 6 + i)
    assert most_resident == 4  # every state row was in use at once


async def test_queue_10_11_two_slots_decode_behind_decode(autojump_clock: Clock) -> None:
    """Covers QUEUE-10 (never more than two frames), QUEUE-11 (only decode queues)."""
    async with toy_runtime(auto_complete=False) as toy:
        async with trio.open_nursery() as nursery:
            results: list[list[StreamEvent]] = []

            async def run() -> None:
                results.append(await collect(toy.runtime, request([1, 2, 3], 40)))

            nursery.start_soon(run)
            depth = []
            while not results:
                await until(lambda: bool(toy.backend.pending()) or bool(results))
                pending = toy.backend.pending()
                if not pending:
                    continue
                depth.append(len(pending))
                if len(pending) == 2:
                    assert all(h.shape.kind is GraphKind.DECODE for h in pending)
                toy.backend.complete_next()
        assert max(depth) == 2
        assert tokens_of(results[0]) == reference_output([1, 2, 3], 40)


async def _cancel_when(toy: ToySystem, launched: Any) -> int:
    """Start a request, leave its block once ``launched(pending)`` holds, return the
    number of launches at that moment."""
    async with toy.runtime.generate(request([5, 6, 7, 8, 9], 30)) as events:
        async for event in events:
            if launched(toy):
                break
            if isinstance(event, Finished):  # pragma: no cover - would be a bug
                raise AssertionError("finished before the cancellation point")
    return len(toy.backend.launches)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
async def test_queue_9_cancel_in_flight_keeps_resources_until_fence(
    autojump_clock: Clock, stage: str
) -> None:
    """Covers QUEUE-8, QUEUE-9, PRE-54: cancelling with a frame in flight stops
    selection at once; row and pages return only when that frame retires."""
    kind = GraphKind.PREFILL if stage == "prefill" else GraphKind.DECODE
    async with toy_runtime(auto_complete=False) as toy, trio.open_nursery() as nursery:
        cancelled = trio.Event()

        async def client() -> None:
            async with toy.runtime.generate(request([5, 6, 7, 8, 9], 30)):
                await until(lambda: any(h.shape.kind is kind
                                        for h in toy.backend.pending()))
            cancelled.set()

        nursery.start_soon(client)
        if kind is GraphKind.DECODE:
            await until(lambda: bool(toy.backend.pending()))
            toy.backend.complete_next()  # the prefill
        await cancelled.wait()
        await trio.testing.wait_all_tasks_blocked()
        stats = toy.runtime.resources.statistics()
        assert stats.residents == 1 and stats.rows_free == stats.rows_total - 1
        launches = len(toy.backend.launches)
        while toy.backend.pending():
            toy.backend.complete_next()
            await trio.testing.wait_all_tasks_blocked()
        await wait_until_idle(toy.runtime)
        assert len(toy.backend.launches) == launches  # nothing new was selected
        await assert_all_returned(toy)


async def test_cancel_while_queued_never_touches_resources(autojump_clock: Clock) -> None:
    async with toy_runtime(state_rows=1, auto_complete=False) as toy:
        async with trio.open_nursery() as nursery:
            first_done: list[list[StreamEvent]] = []

            async def first() -> None:
                first_done.append(await collect(toy.runtime, request([1, 2], 3)))

            nursery.start_soon(first)
            await until(lambda: bool(toy.backend.pending()))
            async with toy.runtime.generate(request([3, 4], 3)):
                await until(lambda: toy.runtime.statistics().requests_waiting == 1)
            await until(lambda: toy.runtime.statistics().requests_waiting == 0)
            while not first_done:
                await until(lambda: bool(toy.backend.pending()) or bool(first_done))
                if toy.backend.pending():
                    toy.backend.complete_next()
        assert tokens_of(first_done[0]) == reference_output([1, 2], 3)
        await wait_until_idle(toy.runtime)
        await assert_all_returned(toy)
        assert toy.runtime.statistics().prompt_tokens_total == 2


async def test_cancel_between_frames_ends_stream_and_frees(autojump_clock: Clock) -> None:
    async with toy_runtime() as toy:
        async with toy.runtime.generate(request([9, 8, 7], 50)) as events:
            first = await events.__anext__()
            assert isinstance(first, TokenDelta)
        await wait_until_idle(toy.runtime)
        await assert_all_returned(toy)
        assert toy.runtime.statistics().generation_tokens_total < 50


async def test_acct_5_slot_reuse_after_cancel(autojump_clock: Clock) -> None:
    """Covers ACCT-5: a request reusing a cancelled request's slot receives only its
    own output, with a larger epoch."""
    async with toy_runtime(state_rows=1) as toy:
        async with toy.runtime.generate(request([1, 1, 1], 50)) as events:
            await events.__anext__()
            old_epoch = toy.runtime.scheduler.request(toy.runtime.scheduler.handles()[0]).epoch
        second = await collect(toy.runtime, request([2, 3, 4], 10))
        assert tokens_of(second) == reference_output([2, 3, 4], 10)
        assert toy.runtime.scheduler.statistics().resident == 0
        assert max(toy.runtime.scheduler._residency.last_epoch.values()) > old_epoch
        await assert_all_returned(toy)


@pytest.mark.parametrize("corruption,fragment", [
    (lambda s: dataclasses.replace(s, token=VOCAB + 3), "vocabulary"),
    (lambda s: dataclasses.replace(s, finite=False), "non-finite"),
    (lambda s: dataclasses.replace(s, logprob=float("nan")), "non-finite"),
    (lambda s: dataclasses.replace(s, row=s.row + 1), "state row"),
])
async def test_acct_6_malformed_lane_fails_only_its_request(
    autojump_clock: Clock, corruption: Any, fragment: str
) -> None:
    """Covers ACCT-6: a malformed lane fails only its own request, with a message."""
    async with toy_runtime(timed=True) as toy:
        async with trio.open_nursery() as nursery:
            victim: list[list[StreamEvent]] = []
            bystander: list[list[StreamEvent]] = []

            async def run_victim() -> None:
                victim.append(await collect(toy.runtime, request([4, 4, 4], 8)))

            nursery.start_soon(run_victim)
            await until(lambda: toy.runtime.statistics().requests_running == 1)
            toy.device.corrupt.append(corruption)
            nursery.start_soon(lambda: _append(bystander, collect(
                toy.runtime, request([6, 6, 6], 8))))
        failed = finished(victim[0])
        assert failed.reason == "error" and fragment in failed.message
        assert tokens_of(bystander[0]) == reference_output([6, 6, 6], 8)
        await wait_until_idle(toy.runtime)
        await assert_all_returned(toy)


async def _append(out: list[list[StreamEvent]], coro: Any) -> None:
    out.append(await coro)


async def test_program_fault_fails_frame_and_runtime_keeps_serving(autojump_clock: Clock
                                                                   ) -> None:
    async with toy_runtime() as toy:
        decode = next(s for s in toy.runtime.scheduler.catalog if s.kind is GraphKind.DECODE)
        toy.backend.fault_next(RuntimeError("device exploded"), shape=None)
        events = await collect(toy.runtime, request([1, 2, 3], 5))
        final = finished(events)
        assert final.reason == "error" and "device exploded" in final.message
        await wait_until_idle(toy.runtime)
        await assert_all_returned(toy)
        again = await collect(toy.runtime, request([1, 2, 3], 5))
        assert tokens_of(again) == reference_output([1, 2, 3], 5)
        assert decode in toy.runtime.scheduler.catalog


async def test_admission_refusals(autojump_clock: Clock) -> None:
    async with toy_runtime(max_context=32, max_queue=1, state_rows=1,
                           auto_complete=False) as toy:
        rt = toy.runtime
        with pytest.raises(ContextTooLong):
            async with rt.generate(request(list(range(20)), 20)):
                pass
        with pytest.raises(InvalidRequest):
            async with rt.generate(request([VOCAB + 1], 2)):
                pass
        with pytest.raises(InvalidRequest):
            async with rt.generate(request([], 2)):
                pass
        async with trio.open_nursery() as nursery:
            async def hold(prompt: list[int]) -> None:
                async with rt.generate(request(prompt, 2)):
                    await trio.sleep_forever()

            nursery.start_soon(hold, [1])  # resident
            await until(lambda: rt.statistics().requests_running == 1)
            nursery.start_soon(hold, [2])  # queued
            await until(lambda: rt.statistics().requests_waiting == 1)
            with pytest.raises(QueueFull) as refused:
                async with rt.generate(request([3], 2)):
                    pass
            assert refused.value.retry_after_s >= 1
            nursery.cancel_scope.cancel()
        while toy.backend.pending():
            toy.backend.complete_next()
    with pytest.raises(RuntimeShutDown):
        async with rt.generate(request([1], 2)):
            pass


async def test_pre_53_second_turn_hits_prefix_cache(autojump_clock: Clock) -> None:
    """Covers PRE-53, OPEN-35: the next turn of a conversation reuses the finished
    turn's published pages (fewer prompt tokens run, same output)."""
    turn_one = list(range(1, 15))
    async with toy_runtime() as toy:
        first = await collect(toy.runtime, request(turn_one, 9))
        output = tokens_of(first)
        turn_two = [*turn_one, *output, 30, 31, 32]
        before = toy.device.prompt_tokens_run
        second = await collect(toy.runtime, request(turn_two, 6))
        ran = toy.device.prompt_tokens_run - before
        await assert_all_returned(toy)
    final = finished(second)
    assert final.cached_prompt_tokens == 22  # five full pages of 4 and a 2-token tail
    assert ran == len(turn_two) - 22
    assert tokens_of(second) == reference_output(turn_two, 6)


async def test_acct_17_publication_reported_before_next_completion(autojump_clock: Clock
                                                                   ) -> None:
    """Covers ACCT-17, ACCT-14, OPEN-20: for every fence that produced tokens, the
    planner reports its publication (visible or not) before completing the next."""
    calls: list[tuple[str, int]] = []
    async with toy_runtime(timed=True) as toy:
        sched = toy.runtime.scheduler
        complete, published, nothing = (sched.complete, sched.published_output,
                                        sched.nothing_published)

        def record_complete(fence: Any, records: Any, timing: Any) -> Any:
            calls.append(("complete", int(fence)))
            return complete(fence, records, timing)

        def record_published(handle: Any, fence: Any, host_ns: int) -> None:
            calls.append(("published", int(fence)))
            published(handle, fence, host_ns)

        def record_nothing(handle: Any, fence: Any) -> None:
            calls.append(("published", int(fence)))
            nothing(handle, fence)

        sched.complete = record_complete  # type: ignore[method-assign]
        sched.published_output = record_published  # type: ignore[method-assign]
        sched.nothing_published = record_nothing  # type: ignore[method-assign]
        stop = ToyCodec().decode(reference_output([2, 2, 2], 10))[4:6]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, toy.runtime, request([1, 2, 3], 10))
            nursery.start_soon(collect, toy.runtime, request([2, 2, 2], 10, stop=(stop,)))
    completes = [f for kind, f in calls if kind == "complete"]
    assert len(completes) > 10
    for index, (kind, fence) in enumerate(calls):
        if kind != "published":
            continue
        # No later completion happened between this fence's completion and its report.
        since = calls[calls.index(("complete", fence)):index]
        assert [k for k, _ in since].count("complete") == 1


async def test_shutdown_ends_open_streams_and_stops(autojump_clock: Clock) -> None:
    """Two-phase shutdown: leaving ``open_runtime`` ends every open stream (resident
    and queued) with ``cancelled`` and frees everything, without hanging."""
    finals: list[Finished] = []
    async with toy_runtime(state_rows=1, timed=True) as toy:

        async def client(prompt: list[int]) -> None:
            async with toy.runtime.generate(request(prompt, 200, ignore_eos=True)) as events:
                async for event in events:
                    if isinstance(event, Finished):
                        finals.append(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, [1, 2, 3])
            nursery.start_soon(client, [4, 5, 6])
            await until(lambda: toy.runtime.statistics().requests_waiting == 1)
            book = toy.runtime.resources
            await toy_exit(toy)
    assert sorted(f.reason for f in finals) == ["cancelled", "cancelled"]
    stats = book.statistics()
    assert stats.residents == 0 and stats.rows_free == stats.rows_total


async def toy_exit(toy: ToySystem) -> None:
    """Close admission the way leaving ``open_runtime`` does, then wait for the drain."""
    toy.runtime._close_admission()
    await wait_until_idle(toy.runtime)


async def test_ver_28_mixed_frames_pack_prompt_and_decode_rows(autojump_clock: Clock) -> None:
    """Covers VER-28 (input packing), MIX-9: a prompt row packed beside decode rows."""
    prompts = [[(3 * i + j) % 30 for j in range(5 + 20 * i)] for i in range(4)]
    results: dict[int, list[StreamEvent]] = {}
    async with toy_runtime(timed=True, mixed=True) as toy:

        async def one(i: int) -> None:
            await trio.sleep(0.003 * i)  # arrive while others decode
            results[i] = await collect(toy.runtime, request(prompts[i], 12))

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        graphs = dict(toy.runtime.statistics().executions_by_graph)
        await assert_all_returned(toy)
    for i, prompt in enumerate(prompts):
        assert tokens_of(results[i]) == reference_output(prompt, 12)
    assert any(label.startswith("mixed") for label in graphs), graphs


async def test_request_larger_than_the_page_pool_is_refused(autojump_clock: Clock) -> None:
    """A worst case beyond the whole pool could never be granted: refuse it up front."""
    async with toy_runtime(num_pages=4, max_context=256) as toy:  # 16 positions
        with pytest.raises(ContextTooLong):
            async with toy.runtime.generate(request([1] * 10, 8)):
                pass
        assert tokens_of(await collect(toy.runtime, request([1] * 10, 6))) == \
            reference_output([1] * 10, 6)
