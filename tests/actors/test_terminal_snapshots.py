"""Terminal snapshot frames through the runtime (seed *Prerequisites and completion*):
with a SNAPSHOT shape in the catalog every normal completion ends with a scheduled
state-operation frame whose copy of the partial page is what the prefix cache
publishes (PRE-38, PRE-39, PRE-53), fenced through cancellation (PRE-54, QUEUE-29).
Toy programs on the fake backend and trio's autojump clock."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from actors.messages import PageId
from actors.public import Finished, StreamEvent, TokenDelta
from actors.system import Runtime
from policy.descriptors import GraphKind
from tests.actors.toy import ToyCodec, ToySystem, reference_output, request, toy_runtime, until

Clock = trio.testing.MockClock


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
    await until(lambda: toy.runtime.resources.statistics().residents == 0)
    stats = toy.runtime.resources.statistics()
    assert stats.rows_free == stats.rows_total
    assert stats.pages_total - stats.pages_free == stats.pages_cached


async def test_pre_38_finished_only_after_the_terminal_snapshot(autojump_clock: Clock
                                                                ) -> None:
    """Covers PRE-38, PRE-39: a normal completion runs one snapshot frame, and the
    client's Finished event arrives only after that frame completed; then the row and
    every page not published are free."""
    prompt = list(range(1, 10))
    async with toy_runtime(timed=True, snapshots=True) as toy:
        events, finished_ns = await collect_timed(toy.runtime, request(prompt, 3))
        snaps = state_frames(toy)
        await assert_all_returned(toy)
    final = events[-1]
    assert isinstance(final, Finished) and final.reason == "length"
    assert tokens_of(events) == reference_output(prompt, 3)
    assert len(snaps) == 1
    assert snaps[0].observed_ns <= finished_ns
    # The snapshot copied the validated extent: 9 prompt positions and 2 outputs.
    ((_, position, dst_page),) = toy.device.snapshots
    assert position == 11 and dst_page >= 0


async def test_pre_53_next_turn_reuses_the_snapshot_copy(autojump_clock: Clock) -> None:
    """Covers PRE-39, PRE-53, PRE-37: the published partial page is the snapshot's
    copy (the request's own partial page went back to the pool), and the next turn
    takes it, running only its new tokens with the reference output."""
    turn_one = list(range(1, 15))
    async with toy_runtime(timed=True, snapshots=True) as toy:
        first, _ = await collect_timed(toy.runtime, request(turn_one, 9))
        ((_, position, dst_page),) = toy.device.snapshots
        assert position == 22  # 14 prompt + 8 written outputs; tail of 2 in page 5
        # The snapshot destination holds the 2-token tail (positions 20 and 21).
        tail = [*turn_one, *tokens_of(first)][20:22]
        assert [toy.device.kv[dst_page][i] for i in (0, 1)] == tail
        await assert_all_returned(toy)
        book = toy.runtime.resources
        assert book.pages.references(PageId(dst_page)) == 1  # held by the cache only
        assert book.statistics().pages_cached == 6  # five full pages and the copy
        turn_two = [*turn_one, *tokens_of(first), 30, 31, 32]
        before = toy.device.prompt_tokens_run
        second, _ = await collect_timed(toy.runtime, request(turn_two, 6))
        ran = toy.device.prompt_tokens_run - before
        await assert_all_returned(toy)
    final = second[-1]
    assert isinstance(final, Finished)
    assert final.cached_prompt_tokens == 22
    assert ran == len(turn_two) - 22
    assert tokens_of(second) == reference_output(turn_two, 6)


async def test_page_boundary_snapshot_copies_no_page(autojump_clock: Clock) -> None:
    """Covers PRE-37: a written extent ending on a page boundary has no partial page,
    so the snapshot copies none (destination -1) and every page returns."""
    prompt = list(range(1, 8))  # 7 prompt + 1 written output = 8 = two pages of 4
    async with toy_runtime(timed=True, snapshots=True) as toy:
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
        events, _ = await collect_timed(toy.runtime, request(prompt, 12, stop=(stop_text,)))
        await assert_all_returned(toy)
        cached = toy.runtime.resources.statistics().pages_cached
    final = events[-1]
    assert isinstance(final, Finished) and final.reason == "stop"
    assert toy.device.snapshots == []
    assert cached >= 2


async def test_pre_54_cancel_while_snapshot_in_flight_frees_after_fence(
        autojump_clock: Clock) -> None:
    """Covers PRE-54, QUEUE-29: a request whose snapshot frame is in flight keeps its
    row, pages and snapshot destination until that fence retires."""
    prompt = list(range(1, 10))
    async with toy_runtime(auto_complete=False, snapshots=True) as toy:
        rt = toy.runtime
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_timed, rt, request(prompt, 3))
            # Complete frames until the snapshot is the one pending.
            while True:
                await until(lambda: bool(toy.backend.pending()))
                if toy.backend.pending()[0].shape.kind is GraphKind.STATE:
                    break
                toy.backend.complete_next()
            nursery.cancel_scope.cancel()  # the client leaves during the snapshot
        await trio.testing.wait_all_tasks_blocked()
        stats = rt.resources.statistics()
        assert stats.residents == 1 and stats.rows_free == stats.rows_total - 1
        assert stats.pages_total - stats.pages_free == 4  # 3 written, 1 destination
        toy.backend.complete_next()
        await assert_all_returned(toy)
