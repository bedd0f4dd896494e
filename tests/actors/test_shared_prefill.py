"""Shared prefills: requests of one ``prefill_group`` with one prompt (the ``n`` choices
of an API request) prefill that prompt once; the others start from its published
prompt pages (``ResourceBook``, *Shared prefills*), each still its own request."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actors.messages import Fence, LaneExtent
from actors.public import Finished, GenerationRequest, TokenDelta
from actors.resource_book import ResourceBook
from tests.actors.toy import reference_output, request, toy_runtime, wait_until_idle

PAGE = 4


def test_a_member_waits_for_the_leaders_prompt_pages_then_shares_them() -> None:
    book = ResourceBook(num_pages=32, state_rows=4, page_size=PAGE)
    prompt = list(range(1, 12))  # 11 tokens: two shareable full pages (positions 0..7)
    leader = book.acquire(prompt, 4, prompt_group="g")
    assert leader is not None and leader.cached_tokens == 0
    assert book.acquire(prompt, 4, prompt_group="g") is None  # nothing written yet
    assert book.acquire(prompt, 4, prompt_group="other") is not None  # another group
    assert book.acquire([*prompt[:-1], 30], 4, prompt_group="g") is not None  # other prompt
    book.reserve(Fence(1), [LaneExtent(handle=leader.handle, kv_tokens=4)])
    book.reserve(Fence(2), [LaneExtent(handle=leader.handle, kv_tokens=11)])
    book.retire(Fence(1))
    assert book.acquire(prompt, 4, prompt_group="g") is None  # page 2 still being written
    book.retire(Fence(2))
    member = book.acquire(prompt, 4, prompt_group="g")
    assert member is not None
    assert member.cached_tokens == 8
    assert member.cached_pages == tuple(book.page_table(leader.handle)[:2])


def test_a_leader_that_ends_before_its_prefill_lets_the_members_go() -> None:
    book = ResourceBook(num_pages=32, state_rows=4, page_size=PAGE)
    prompt = list(range(1, 12))
    leader = book.acquire(prompt, 4, prompt_group="g")
    assert leader is not None
    assert book.acquire(prompt, 4, prompt_group="g") is None
    book.release(leader.handle)  # cancelled before any frame: nothing to share
    member = book.acquire(prompt, 4, prompt_group="g")
    assert member is not None and member.cached_tokens == 0


def test_a_rejected_prefill_lane_shares_nothing() -> None:
    book = ResourceBook(num_pages=32, state_rows=4, page_size=PAGE)
    prompt = list(range(1, 12))
    leader = book.acquire(prompt, 4, prompt_group="g")
    assert leader is not None
    book.reserve(Fence(1), [LaneExtent(handle=leader.handle, kv_tokens=11)])
    book.retire(Fence(1), failed=[leader.handle])  # its KV may be garbage
    assert book.acquire(prompt, 4, prompt_group="g") is None  # still resident
    book.release(leader.handle)  # the failed request publishes nothing
    member = book.acquire(prompt, 4, prompt_group="g")
    assert member is not None and member.cached_tokens == 0


def test_a_prompt_within_one_page_holds_nobody_back() -> None:
    book = ResourceBook(num_pages=32, state_rows=4, page_size=PAGE)
    assert book.acquire([5, 6, 7], 4, prompt_group="g") is not None
    assert book.acquire([5, 6, 7], 4, prompt_group="g") is not None


async def _run_together(requests: list[GenerationRequest], log: list[tuple[int, str, int]],
                        *, decode_prompt_tail: bool = True) -> tuple[int, list[list[int]]]:
    """Submit ``requests`` at the same instant; the prompt tokens the device ran and
    every request's output. ``log`` gets (request, event kind, resident requests then)
    in arrival order."""
    async with toy_runtime(decode_prompt_tail=decode_prompt_tail) as toy:
        outputs: list[list[int]] = [[] for _ in requests]

        async def one(i: int) -> None:
            async with toy.runtime.generate(requests[i]) as events:
                async for event in events:
                    log.append((i, type(event).__name__,
                                toy.runtime.resources.statistics().residents))
                    if isinstance(event, TokenDelta):
                        outputs[i].extend(event.token_ids)
                    else:
                        assert not isinstance(event, Finished) or event.reason == "length"

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
        await wait_until_idle(toy.runtime)
        return toy.device.prompt_tokens_run, outputs


@pytest.mark.parametrize("decode_prompt_tail", [True, False])
async def test_siblings_admitted_together_prefill_their_prompt_once(
        autojump_clock: trio.testing.MockClock, decode_prompt_tail: bool) -> None:
    prompt = list(range(1, 30))  # 29 tokens, page 4: 28 positions shareable
    grouped = [request(prompt, 12, request_id=f"r-{i}", prefill_group="r")
               for i in range(3)]
    log: list[tuple[int, str, int]] = []
    ran, outputs = await _run_together(grouped, log, decode_prompt_tail=decode_prompt_tail)
    # each sibling's uncached last token: its first decode step's input, or a prompt chunk
    assert ran == len(prompt) + (0 if decode_prompt_tail else 2 * (len(prompt) - 28))
    assert outputs == [reference_output(prompt, 12)] * 3
    # the others are granted once the prompt pages are published, not when the first
    # one ends: all three are resident while the first still streams
    leader = log[0][0]
    leader_done = next(k for k, (i, kind, _) in enumerate(log)
                       if i == leader and kind == "Finished")
    assert max(residents for _, _, residents in log[:leader_done]) == 3
    # without the group the three arrive before any page is published: three prefills
    alone = [request(prompt, 12, request_id=f"r-{i}") for i in range(3)]
    ran_alone, outputs_alone = await _run_together(alone, [])
    assert ran_alone == 3 * len(prompt)
    assert outputs_alone == outputs
