"""``Runtime.statistics()`` separates KV pages in use by requests from pages the prefix
cache alone holds (an idle server with a warm cache reports none in use), and a
cancelled runtime still closes its backend."""

from __future__ import annotations

import trio
import trio.testing

from actors.public import RuntimeStatistics
from actors.system import Runtime
from tests.actors.toy import request, toy_runtime, wait_until_idle


async def test_cached_pages_are_not_counted_as_in_use(
        autojump_clock: trio.testing.MockClock) -> None:
    prompt = list(range(1, 40))
    async with toy_runtime() as toy:
        idle = toy.runtime.statistics()
        assert (idle.kv_pages_used, idle.kv_pages_cached) == (0, 0)
        seen: list[tuple[int, int]] = []
        async with toy.runtime.generate(request(prompt, 6)) as events:
            async for _ in events:
                stats = toy.runtime.statistics()
                seen.append((stats.kv_pages_used, stats.kv_pages_cached))
        await wait_until_idle(toy.runtime)
        after = toy.runtime.statistics()
        pool = toy.runtime.resources.pages
    assert max(used for used, _ in seen) > 0  # a running request's pages are in use
    assert after.kv_pages_used == 0
    assert after.kv_pages_cached == pool.used_count > 0  # the warm cache holds them
    assert after.kv_pages_total == pool.total


async def _statistics_mid_stream(runtime: Runtime, prompt: list[int]) -> RuntimeStatistics:
    """Run one request to its end; the statistics read after its first event."""
    during: RuntimeStatistics | None = None
    async with runtime.generate(request(prompt, 6)) as events:
        async for _ in events:
            during = during or runtime.statistics()
    await wait_until_idle(runtime)
    assert during is not None
    return during


async def test_a_cached_page_a_request_shares_counts_as_in_use(
        autojump_clock: trio.testing.MockClock) -> None:
    prompt = list(range(1, 40))
    async with toy_runtime() as toy:
        await _statistics_mid_stream(toy.runtime, prompt)
        cached = toy.runtime.statistics().kv_pages_cached
        during = await _statistics_mid_stream(toy.runtime, prompt)
    # the second request shares the cached prompt pages: in use, no longer cached-only
    assert cached > 0
    assert during.kv_pages_used > 0
    assert during.kv_pages_cached < cached


async def test_a_cancelled_runtime_still_closes_its_backend(
        autojump_clock: trio.testing.MockClock) -> None:
    """A forced stop cancels the runtime's block; the backend (whose worker threads would
    otherwise outlive the interpreter and abort the process) is closed all the same."""
    with trio.CancelScope() as scope:
        async with toy_runtime() as toy:
            scope.cancel()
            await trio.sleep_forever()
    assert toy.backend._closed
