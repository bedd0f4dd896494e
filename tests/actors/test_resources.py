"""The checkpoint-allocator's pure core: page pool, state rows, prefix cache, anchors,
fenced retirement. Covers QUEUE-9, QUEUE-16..19, QUEUE-29, QUEUE-30, QUEUE-49, QUEUE-50,
PRE-39, PRE-53, PRE-54, ACCT-5 (fresh epochs on row reuse), OPEN-3.

QUEUE-31 (the ownership rules of docs/runtime.md, *Checkpoints and the prefix cache*),
rule by rule: keys and sharing by reference (test_prefix_cache_shares_full_pages_by_content),
partial pages moved to their only reuser (test_partial_tail_moves_to_its_only_reuser,
test_queue_17_a_diverging_prompt_takes_the_tail_truncated), publication only after the
last fence retires (test_queue_9_queue_50_pages_return_only_when_last_fence_retires,
test_pre_53_terminal_publication_is_seen_by_the_next_turn), retention and eviction
(test_queue_30_victims_by_recency_then_role_then_length,
test_open_3_shared_pages_are_never_evicted, test_open_3_tails_are_evicted_before_their_parents),
preemption accounting through random lifecycles
(test_open_3_random_lifecycles_conserve_pages_and_rows)."""

from __future__ import annotations

import pytest

from actors.checkpoints import anchor_order, checkpoint_roles
from actors.messages import Fence, LaneExtent, PageId, RequestHandle
from actors.page_pool import PagePool, ResourceError, StateRowPool, pages_for
from actors.prefix_cache import CheckpointRole, PrefixCache
from actors.resource_book import ResourceBook

PAGE = 4


def test_page_pool_reference_counts() -> None:
    pool = PagePool(3)
    (a, b) = pool.take(2)
    pool.share([a])
    assert pool.drop([a, b]) == 1  # b freed, a still shared
    assert pool.free_count == 2
    assert pool.drop([a]) == 1
    with pytest.raises(ResourceError):
        pool.drop([a])


def test_acct_5_row_reuse_gets_a_larger_epoch() -> None:
    rows = StateRowPool(1)
    row, first = rows.take()
    rows.give_back(row)
    again, second = rows.take()
    assert again == row and second > first


def test_pages_for_rounds_up() -> None:
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_prefix_cache_shares_full_pages_by_content() -> None:
    pool = PagePool(8)
    cache = PrefixCache(pool, PAGE)
    pages = pool.take(3)
    tokens = list(range(10))  # two full pages + a partial one
    assert cache.publish(tokens, pages) == 3  # two full pages and the partial tail
    assert pool.references(pages[0]) == 2 and pool.references(pages[2]) == 2
    hit = cache.lookup([*range(8), 99, 98], limit_tokens=9)
    assert hit.pages == pages[:2] and hit.tokens == 8
    miss = cache.lookup([0, 1, 2, 7, 4], limit_tokens=4)
    assert miss.pages == ()
    # Same content under a different prefix is a different key.
    assert cache.lookup([9, 9, 9, 9, 4, 5, 6, 7], limit_tokens=8).pages == ()
    pool.drop(hit.pages)


def test_partial_tail_moves_to_its_only_reuser() -> None:
    """Covers OPEN-3 (partial pages): a finished request's partial last page is kept
    without a copy and handed, unshared, to the one request that extends it."""
    pool = PagePool(8)
    cache = PrefixCache(pool, PAGE)
    pages = pool.take(3)
    cache.publish(list(range(10)), pages)
    assert cache.lookup(list(range(11)), limit_tokens=10).tokens == 8  # the request
    pool.drop(pages)  # the finished request lets go; the tail is shared no more
    taken = cache.lookup([*range(10), 7, 7], limit_tokens=11)
    assert taken.pages == pages and taken.tokens == 10
    assert pool.references(pages[2]) == 1  # moved: the cache holds it no longer
    again = cache.lookup([*range(10), 7, 7], limit_tokens=11)
    assert again.tokens == 8
    # An unusable hit gives its tail back.
    pool.drop(again.pages)
    tail_page = pool.take(1)
    cache.publish([*range(8), 3, 3], [*pages[:2], *tail_page])
    pool.drop(tail_page)
    refused = cache.lookup([*range(8), 3, 3, 1], limit_tokens=11)
    assert refused.tokens == 10 and refused.pages[-1] == tail_page[0]
    cache.give_back(refused)
    assert pool.references(tail_page[0]) == 1  # the cache's reference again
    assert cache.lookup([*range(8), 3, 3, 1], limit_tokens=11).tokens == 10
    # A tail that a resident request still shares is never taken.
    other = pool.take(2)
    cache.publish([5, 5, 5, 5, 6, 6], other)
    assert cache.lookup([5, 5, 5, 5, 6, 6, 1], limit_tokens=6).tokens == 4


def test_queue_30_victims_by_recency_then_role_then_length() -> None:
    pool = PagePool(16)
    cache = PrefixCache(pool, PAGE)
    old = pool.take(1)
    cache.publish([1, 1, 1, 1], old, roles={0: CheckpointRole.TERMINAL})
    new_a = pool.take(1)
    cache.publish([2, 2, 2, 2], new_a, roles={0: CheckpointRole.TERMINAL})
    pool.drop([*old, *new_a])  # only the cache holds them now
    assert cache.evict(1) == 1
    assert cache.lookup([1, 1, 1, 1, 0], limit_tokens=4).pages == ()  # least recent went
    assert cache.lookup([2, 2, 2, 2, 0], limit_tokens=4).pages == new_a
    pool.drop(new_a)
    # Equal recency: weaker role first, then the longer endpoint first.
    chain = pool.take(3)
    cache.publish([5] * 12, chain, roles={1: CheckpointRole.MESSAGE})
    pool.drop(chain)
    nodes = {n.page: n for n in cache._nodes.values()}
    first, message, last = (nodes[p] for p in chain)
    key = cache.victim_order_key
    assert key(last) < key(first)  # same role and demand: the longer endpoint goes first
    assert key(first) < key(message)  # same demand: interior before a message anchor
    assert cache.evict(3) == 3 and pool.free_count == 15


def test_open_3_shared_pages_are_never_evicted() -> None:
    pool = PagePool(4)
    cache = PrefixCache(pool, PAGE)
    pages = pool.take(2)
    cache.publish(list(range(8)), pages)
    pool.drop(pages)
    hit = cache.lookup(list(range(9)), limit_tokens=8)  # a request shares both
    assert cache.evict(2) == 0
    pool.drop(hit.pages)
    assert cache.evict(2) == 2
    assert pool.free_count == 4


def test_queue_17_to_19_anchor_order() -> None:
    assert anchor_order(100, [10, 40, 70]) == (70, 40, 10, 100)
    assert anchor_order(100, [10, 100], cached_tokens=20) == (100,)
    assert anchor_order(50, []) == (50,)


def test_checkpoint_roles_mark_anchor_pages() -> None:
    roles = checkpoint_roles(prompt_len=10, message_ends=[5], kv_tokens=13, page_size=PAGE,
                             terminal=True)
    assert roles == {0: CheckpointRole.MESSAGE, 1: CheckpointRole.PROMPT_END,
                     3: CheckpointRole.TERMINAL}  # the partial tail holds position 12


def book(pages: int = 8, rows: int = 2) -> ResourceBook:
    return ResourceBook(num_pages=pages, state_rows=rows, page_size=PAGE)


def test_acquire_reserves_the_worst_case_budget() -> None:
    b = book(pages=4)
    first = b.acquire(list(range(6)), max_tokens=3)  # 8 positions -> 2 pages
    assert first is not None
    second = b.acquire(list(range(6)), max_tokens=3)
    assert second is not None
    assert b.acquire([1], max_tokens=1) is None  # no row left
    b2 = book(pages=3)
    assert b2.acquire(list(range(8)), max_tokens=1) is not None
    assert b2.acquire(list(range(8)), max_tokens=1) is None  # budget would exceed the pool


def test_queue_9_queue_50_pages_return_only_when_last_fence_retires() -> None:
    b = book()
    grant = b.acquire([1, 2, 3], max_tokens=4)
    assert grant is not None
    plans = b.reserve(Fence(1), [LaneExtent(handle=grant.handle, kv_tokens=3)])
    assert [len(p.page_ids) for p in plans] == [1]
    b.reserve(Fence(2), [LaneExtent(handle=grant.handle, kv_tokens=5)])
    assert b.pages.used_count == 2
    assert b.release(grant.handle) is False  # fence 2 still in flight
    assert b.retire(Fence(1)) == 0
    assert b.pages.used_count == 2 and b.rows.free_count == 1
    assert b.retire(Fence(2)) == 1
    assert b.pages.used_count == 0 and b.rows.free_count == 2


def test_pre_53_terminal_publication_is_seen_by_the_next_turn() -> None:
    b = book()
    prompt = list(range(6))
    grant = b.acquire(prompt, max_tokens=4)
    assert grant is not None and grant.cached_tokens == 0
    b.reserve(Fence(1), [LaneExtent(handle=grant.handle, kv_tokens=9)])
    b.retire(Fence(1))
    output = [50, 51, 52, 53]
    written = prompt + output[:-1]  # the last sampled token has no KV yet
    assert b.release(grant.handle, token_ids=written, kv_tokens=len(written), publish=True)
    follow_up = b.acquire([*prompt, *output, 60, 61], max_tokens=2)
    assert follow_up is not None and follow_up.cached_tokens == 9  # two pages + the tail
    assert follow_up.epoch > grant.epoch


def test_reserve_evicts_unreferenced_cache_pages() -> None:
    b = book(pages=3, rows=1)
    g = b.acquire(list(range(8)), max_tokens=1)
    assert g is not None
    b.reserve(Fence(1), [LaneExtent(handle=g.handle, kv_tokens=8)])
    b.retire(Fence(1))
    b.release(g.handle, token_ids=list(range(8)), kv_tokens=8, publish=True)
    assert b.statistics().pages_cached == 2 and b.pages.free_count == 1
    g2 = b.acquire([9] * 9, max_tokens=3)  # needs 3 pages: must count evictable ones
    assert g2 is not None
    plans = b.reserve(Fence(2), [LaneExtent(handle=g2.handle, kv_tokens=11)])
    assert sum(len(p.page_ids) for p in plans) == 3
    assert b.statistics().pages_cached == 0


def test_release_without_frames_is_immediate_and_unknown_reserve_raises() -> None:
    b = book()
    g = b.acquire([1, 2], max_tokens=2)
    assert g is not None
    assert b.release(g.handle)
    with pytest.raises(ResourceError):
        b.reserve(Fence(1), [LaneExtent(handle=g.handle, kv_tokens=1)])
    assert b.pages.used_count == 0 and b.rows.free_count == 2
    assert RequestHandle(0) == g.handle and isinstance(PageId(1), int)


def test_open_3_random_lifecycles_conserve_pages_and_rows() -> None:
    """Random acquire / reserve / release / retire sequences: the budget invariant holds,
    reservations never fail for a granted request, and once everything retires only the
    prefix cache holds pages (QUEUE-9, QUEUE-49, QUEUE-50, OPEN-3)."""
    import random

    rng = random.Random(1234)
    b = ResourceBook(num_pages=24, state_rows=3, page_size=PAGE)
    live: dict[RequestHandle, tuple[list[int], int, int]] = {}  # tokens, kv, max extent
    fence = 0
    in_flight: list[int] = []
    for _ in range(600):
        action = rng.random()
        if action < 0.3:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            max_tokens = rng.randrange(1, 10)
            grant = b.acquire(prompt, max_tokens)
            if grant is not None:
                assert grant.cached_tokens < len(prompt)
                live[grant.handle] = (prompt, grant.cached_tokens, len(prompt) + max_tokens - 1)
        elif action < 0.65 and live:
            handle = rng.choice(list(live))
            tokens, kv, limit = live[handle]
            if kv < limit:
                fence += 1
                kv = min(limit, kv + rng.randrange(1, 6))
                b.reserve(Fence(fence), [LaneExtent(handle=handle, kv_tokens=kv)])
                in_flight.append(fence)
                tokens = tokens + [rng.randrange(3) for _ in range(kv - len(tokens))]
                live[handle] = (tokens, kv, limit)
        elif action < 0.8 and in_flight:
            b.retire(Fence(in_flight.pop(0)))
        elif live:
            handle = rng.choice(list(live))
            tokens, kv, _ = live.pop(handle)
            b.release(handle, token_ids=tokens[:kv], kv_tokens=kv, publish=rng.random() < 0.7)
        assert b._available_pages() >= 0  # free + evictable cover every budget
    for handle in list(live):
        b.release(handle)
    for f in in_flight:
        b.retire(Fence(f))
    stats = b.statistics()
    assert stats.residents == 0 and stats.rows_free == stats.rows_total
    assert stats.pages_total - stats.pages_free == stats.pages_cached
    b.cache.clear()
    assert b.pages.free_count == b.pages.total


def test_open_3_tails_are_evicted_before_their_parents() -> None:
    """A page with a cached tail is not a leaf: eviction takes the tail first, and the
    parent only when asked for more, so no tail is ever orphaned."""
    pool = PagePool(4)
    cache = PrefixCache(pool, PAGE)
    pages = pool.take(2)
    cache.publish([1, 1, 1, 1, 2, 2], pages)
    pool.drop(pages)
    assert cache.evict(1) == 1
    assert cache.lookup([1, 1, 1, 1, 2, 2, 3], limit_tokens=6).tokens == 4  # tail gone
    pool.drop([pages[0]])
    assert cache.evict(5) == 1 and pool.free_count == 4
    assert cache.statistics().pages == 0


def snapshot_book(pages: int = 8, rows: int = 3) -> ResourceBook:
    return ResourceBook(num_pages=pages, state_rows=rows, page_size=PAGE, snapshot_lanes=1)


def test_pre_39_snapshot_book_keeps_a_scratch_row_and_guards_a_destination() -> None:
    """A snapshot book keeps its last row as scratch; the destination page is a guard
    beside the worst-case KV budget, not part of it (QUEUE-27)."""
    b = snapshot_book(rows=3)
    assert b.scratch_rows == (2,) and b.rows.total == 2
    assert b.budget_for(6, 3) == pages_for(8, PAGE)
    assert b.acquire(list(range(6)), max_tokens=3) is not None
    assert b.statistics().destination_guards == 1
    with pytest.raises(ResourceError):
        ResourceBook(num_pages=4, state_rows=1, page_size=PAGE, snapshot_lanes=1)


def test_pre_37_snapshot_plan_copies_only_a_partial_page() -> None:
    """Covers PRE-37: a snapshot at a page boundary needs no destination; mid-page it
    takes one page (once, however often the plan is reserved again)."""
    b = snapshot_book()
    g = b.acquire(list(range(6)), max_tokens=3)
    assert g is not None
    b.reserve(Fence(1), [LaneExtent(handle=g.handle, kv_tokens=8)])
    (boundary,) = b.reserve(Fence(2), [LaneExtent(handle=g.handle, kv_tokens=8,
                                                   snapshot=True)])
    assert boundary.dst_page == -1 and len(boundary.page_ids) == 2
    (mid,) = b.reserve(Fence(3), [LaneExtent(handle=g.handle, kv_tokens=7, snapshot=True)])
    (again,) = b.reserve(Fence(4), [LaneExtent(handle=g.handle, kv_tokens=7, snapshot=True)])
    assert mid.dst_page >= 0 and again.dst_page == mid.dst_page
    assert mid.scratch_row == b.scratch_rows[0] and mid.row == g.row


def test_pre_39_snapshot_copy_replaces_the_partial_page_on_publication() -> None:
    """Covers PRE-39, PRE-53: after a completed snapshot the destination page is the
    published tail and the request's own partial page is freed; without a completed
    snapshot the destination is dropped and the host tail is published."""
    for done in (True, False):
        b = snapshot_book()
        prompt = list(range(10, 16))
        g = b.acquire(prompt, max_tokens=2)
        assert g is not None
        b.reserve(Fence(1), [LaneExtent(handle=g.handle, kv_tokens=6)])
        own_tail = b.page_table(g.handle)[1]
        (snap,) = b.reserve(Fence(2), [LaneExtent(handle=g.handle, kv_tokens=6,
                                                   snapshot=True)])
        b.release(g.handle, token_ids=prompt, kv_tokens=6, publish=True, snapshot_done=done)
        b.retire(Fence(2))
        published_tail = snap.dst_page if done else own_tail
        dropped = own_tail if done else snap.dst_page
        assert b.pages.references(PageId(published_tail)) == 1
        assert b.pages.references(PageId(dropped)) == 0
        assert b.statistics().pages_cached == 2
        assert b.rows.free_count == b.rows.total


def test_queue_17_a_diverging_prompt_takes_the_tail_truncated() -> None:
    """Covers QUEUE-17, OPEN-3: a prompt that shares only the first tokens of an
    unshared partial tail (a turn that keeps the anchor but not the answer) takes the
    tail, truncated to the common prefix; a shared tail or no common token is left."""
    pool = PagePool(8)
    cache = PrefixCache(pool, PAGE)
    pages = pool.take(3)
    cache.publish([*range(8), 20, 21, 22], pages)  # tail (20, 21, 22) after two pages
    held = cache.lookup([*range(8), 20, 30, 31], limit_tokens=10)
    assert held.tokens == 8  # the finished request still shares the tail
    pool.drop(held.pages)
    pool.drop(pages)
    assert cache.lookup([*range(8), 40, 41], limit_tokens=9).tokens == 8  # no common token
    pool.drop(pages[:2])
    taken = cache.lookup([*range(8), 20, 30, 31], limit_tokens=10)
    assert taken.tokens == 9 and taken.pages == pages
    assert pool.references(pages[2]) == 1  # moved to the taker
    cache.give_back(taken)
    assert cache.lookup([*range(8), 20, 21, 22, 1], limit_tokens=11).tokens == 11


def test_a_prompt_found_whole_copies_the_page_it_ends_in() -> None:
    """``copy_last_page``: the rest of the prompt begins a cached page (here one a
    longer request filled): the hit reaches the limit through that page, held for the
    caller (not evictable) until ``give_back`` or the caller drops it."""
    pool = PagePool(8)
    cache = PrefixCache(pool, PAGE)
    pages = pool.take(3)
    cache.publish(list(range(12)), pages)  # three full pages
    pool.drop(pages)
    prompt = list(range(10))  # ends inside the third page
    plain = cache.lookup(prompt, limit_tokens=9)
    assert plain.tokens == 8 and plain.copy_source is None
    cache.give_back(plain)
    hit = cache.lookup(prompt, limit_tokens=9, copy_last_page=True)
    assert hit.pages == pages[:2] and hit.tokens == 9 and hit.copy_source == pages[2]
    assert pool.references(pages[2]) == 2 and cache.evict(8) == 0
    cache.give_back(hit)
    assert pool.references(pages[2]) == 1 and cache.evict(8) == 3
    assert cache.lookup([0, 1, 2, 3, 4, 5, 6, 7, 9, 9], limit_tokens=9,
                        copy_last_page=True).copy_source is None
