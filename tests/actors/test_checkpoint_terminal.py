"""Terminal capture frames through the runtime (seed *Prerequisites and completion*,
*Planning and the execution queue*): with a SNAPSHOT shape in the catalog, a normal
completion whose checkpoint allowance pays for it ends with a scheduled
state-operation frame whose copy of the partial page is what the prefix cache
publishes (PRE-37, PRE-39, QUEUE-20..23). The terminal snapshot enables the visible
completion: the client's ``Finished`` comes only after the capture completed (PRE-38),
so the conversation's next turn always finds the published checkpoint (PRE-53,
OPEN-35). Captures are fenced through cancellation (PRE-54, QUEUE-29). Toy programs on the fake backend and trio's autojump
clock."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from actors.messages import PageId
from actors.public import Finished, StreamEvent, TokenDelta
from actors.system import Runtime
from policy.descriptors import GraphKind
from tests.actors.toy import (
    SNAPSHOT_SHAPE,
    ToyCodec,
    ToySystem,
    reference_output,
    request,
    toy_durations,
    toy_runtime,
    until,
    wait_until_idle,
)

Clock = trio.testing.MockClock


def measure_snapshot(toy: ToySystem, duration_ns: int | None = None) -> None:
    """What ``open_runtime``'s start-up calibration does on a real backend: the
    snapshot program's cost is known before the first capture (QUEUE-22)."""
    cost = toy_durations(SNAPSHOT_SHAPE) if duration_ns is None else duration_ns
    toy.runtime.scheduler.estimates.observe(SNAPSHOT_SHAPE, cost,
                                            int(trio.current_time() * 1e9))


async def collect_timed(rt: Runtime, req: Any) -> tuple[list[StreamEvent], int]:
    """The events and the virtual time (ns) at which ``Finished`` arrived."""
    async with rt.generate(req) as events:
        out = [event async for event in events]
    return out, int(trio.current_time() * 1e9)


def tokens_of(events: list[StreamEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]


def state_frames(toy: ToySystem) -> list[Any]:
    return [r for r in toy.runtime.frame_log() if r.graph.startswith(GraphKind.STATE.value)]


async def assert_all_returned(toy: ToySystem) -> None:
    await wait_until_idle(toy.runtime)
    stats = toy.runtime.resources.statistics()
    assert stats.rows_free == stats.rows_total
    assert stats.pages_total - stats.pages_free == stats.pages_cached


async def test_pre_38_finished_comes_after_the_terminal_capture(autojump_clock: Clock) -> None:
    """Covers PRE-38, PRE-39: a normal completion runs one capture frame and the
    client's Finished arrives only once that frame completed; then the row and every
    page not published are free."""
    prompt = list(range(1, 10))
    async with toy_runtime(timed=True, snapshots=True) as toy:
        measure_snapshot(toy)
        events, finished_ns = await collect_timed(toy.runtime, request(prompt, 3))
        await assert_all_returned(toy)
        snaps = state_frames(toy)
    final = events[-1]
    assert isinstance(final, Finished) and final.reason == "length"
    assert tokens_of(events) == reference_output(prompt, 3)
    assert len(snaps) == 1
    assert finished_ns >= snaps[0].observed_ns
    # The capture copied the validated extent: 9 prompt positions and 2 outputs.
    ((_, position, dst_page),) = toy.device.snapshots
    assert position == 11 and dst_page >= 0


async def test_pre_53_an_immediate_next_turn_waits_for_the_capture_and_reuses_it(
        autojump_clock: Clock) -> None:
    """Covers PRE-38, PRE-39, PRE-53, PRE-37, OPEN-35: the next turn is sent the
    moment turn one's Finished arrives, which is after turn one's capture completed;
    it takes the published copy of the partial page (the request's own partial page
    went back to the pool), running only its new tokens with the reference output."""
    turn_one = list(range(1, 15))
    async with toy_runtime(timed=True, snapshots=True) as toy:
        measure_snapshot(toy)
        first, finished_ns = await collect_timed(toy.runtime, request(turn_one, 9))
        assert len(toy.device.snapshots) == 1  # the capture ran before Finished
        turn_two = [*turn_one, *tokens_of(first), 30, 31, 32]
        before = toy.device.prompt_tokens_run
        second, _ = await collect_timed(toy.runtime, request(turn_two, 6))
        ran = toy.device.prompt_tokens_run - before
        # Turn one's capture; turn two's own capture ran before its Finished too.
        assert len(toy.device.snapshots) == 2
        (_, position, dst_page) = toy.device.snapshots[0]
        await assert_all_returned(toy)
        book = toy.runtime.resources
        # 14 prompt + 8 written outputs; the copy holds the 2-token tail and turn two
        # now owns it (moved from the cache on reuse), so it is referenced once.
        assert position == 22
        assert book.pages.references(PageId(dst_page)) == 1
    final = second[-1]
    assert isinstance(final, Finished)
    assert final.cached_prompt_tokens == 22
    assert ran == len(turn_two) - 22
    assert tokens_of(second) == reference_output(turn_two, 6)
    assert state_frames(toy)[0].observed_ns <= finished_ns


async def test_queue_20_23_only_a_capture_the_allowance_pays_for_runs(
        autojump_clock: Clock) -> None:
    """With a 1 ms snapshot, a 9-token prompt and 3 outputs earn 0.2 ms (prefill) and
    0.125 ms (decode): no capture, the host tail is published. A 30-token answer earns
    1.8 ms more from its decodes: its capture runs. Both next turns hit."""
    async with toy_runtime(timed=True, snapshots=True) as toy:
        measure_snapshot(toy, 1_000_000)
        short = list(range(1, 10))
        first, _ = await collect_timed(toy.runtime, request(short, 3))
        await assert_all_returned(toy)
        assert toy.device.snapshots == []
        follow = [*short, *tokens_of(first), 33]
        again, _ = await collect_timed(toy.runtime, request(follow, 2))
        final = again[-1]
        assert isinstance(final, Finished) and final.cached_prompt_tokens == 11
        long = list(range(2, 11))
        await collect_timed(toy.runtime, request(long, 30))
        await assert_all_returned(toy)
        assert len(toy.device.snapshots) == 1


async def test_queue_22_no_capture_without_a_measured_snapshot(autojump_clock: Clock) -> None:
    """An unmeasured snapshot program: captures are disabled, completions publish the
    host tail."""
    async with toy_runtime(timed=True, snapshots=True) as toy:
        await collect_timed(toy.runtime, request(list(range(1, 10)), 30))
        await assert_all_returned(toy)
        assert toy.device.snapshots == [] and toy.runtime.resources.statistics().pages_cached


async def test_page_boundary_snapshot_copies_no_page(autojump_clock: Clock) -> None:
    """Covers PRE-37: a written extent ending on a page boundary has no partial page,
    so the snapshot copies none (destination -1) and every page returns."""
    prompt = list(range(1, 8))  # 7 prompt + 1 written output = 8 = two pages of 4
    async with toy_runtime(timed=True, snapshots=True) as toy:
        measure_snapshot(toy)
        await collect_timed(toy.runtime, request(prompt, 2))
        await assert_all_returned(toy)
    ((_, position, dst_page),) = toy.device.snapshots
    assert (position, dst_page) == (8, -1)


async def test_stop_string_finish_skips_the_snapshot_and_still_publishes(
        autojump_clock: Clock) -> None:
    """A host-side stop (stop string) retires the request without a snapshot frame;
    its pages are still published by the host path and returned (PRE-54)."""
    prompt = list(range(3, 13))
    stop_text = ToyCodec().decode(reference_output(prompt, 12))[5:8]
    async with toy_runtime(timed=True, snapshots=True) as toy:
        measure_snapshot(toy)
        events, _ = await collect_timed(toy.runtime, request(prompt, 12, stop=(stop_text,)))
        await assert_all_returned(toy)
        cached = toy.runtime.resources.statistics().pages_cached
    final = events[-1]
    assert isinstance(final, Finished) and final.reason == "stop"
    assert toy.device.snapshots == []
    assert cached >= 2


async def test_queue_29_a_capture_cancelled_in_flight_keeps_its_resources(
        autojump_clock: Clock) -> None:
    """Covers PRE-54, QUEUE-29: the client waits for its Finished while the capture
    frame is in flight and then goes away. The request keeps its row, pages and armed
    destination until that fence retires, then everything returns."""
    prompt = list(range(1, 10))
    async with toy_runtime(auto_complete=False, snapshots=True) as toy:
        measure_snapshot(toy)
        rt = toy.runtime
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_timed, rt, request(prompt, 3))
            # Complete frames until the capture is the one pending.
            while True:
                await until(lambda: bool(toy.backend.pending()))
                if toy.backend.pending()[0].shape.kind is GraphKind.STATE:
                    break
                toy.backend.complete_next()
            nursery.cancel_scope.cancel()  # the client disconnects during the capture
        await trio.testing.wait_all_tasks_blocked()
        stats = rt.resources.statistics()
        assert stats.residents == 1 and stats.rows_free == stats.rows_total - 1
        assert stats.armed_destinations == 1
        assert stats.pages_total - stats.pages_free == 4  # 3 written, 1 destination
        toy.backend.complete_next()
        await assert_all_returned(toy)
