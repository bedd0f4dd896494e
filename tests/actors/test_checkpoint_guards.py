"""Capture destinations in the checkpoint-allocator's book (``ResourceBook``): guards,
arming, revocation, fenced retention, and the PRE-53 hold for continuations of a
request whose checkpoint is still to be published. Covers QUEUE-25, QUEUE-27,
QUEUE-28, QUEUE-29, PRE-53, OPEN-35."""

from __future__ import annotations

import random

from actors.messages import Fence, Grant, LaneExtent, PageId, SnapshotPlan
from actors.resource_book import ResourceBook

PAGE = 4
PROMPT = list(range(10, 16))  # 6 tokens; with max_tokens=3 the budget is 2 pages


def book(pages: int) -> ResourceBook:
    return ResourceBook(num_pages=pages, state_rows=4, page_size=PAGE, snapshot_lanes=1)


def admit(b: ResourceBook, prompt: list[int] | None = None, max_tokens: int = 3) -> Grant:
    grant = b.acquire(prompt or PROMPT, max_tokens=max_tokens)
    assert grant is not None
    return grant


def guards(b: ResourceBook) -> int:
    return b.statistics().destination_guards


def test_queue_27_a_guarded_destination_is_protected_from_optional_captures() -> None:
    """Five pages, two budgets of two: one spare page, guarded for the first request.
    The second request's optional capture cannot take it; the first's can."""
    b = book(5)
    first, second = admit(b), admit(b, [20, 21, 22, 23, 24, 25])
    assert guards(b) == 1
    assert b.arm_destination(second.handle) is None
    page = b.arm_destination(first.handle)
    assert page is not None and b.pages.references(page) == 1
    assert b.arm_destination(first.handle) == page  # arming again: the same page
    assert guards(b) == 0 and b.statistics().armed_destinations == 1


def test_queue_25_no_obtainable_destination_reduces_the_capture_to_full_pages() -> None:
    """A terminal lane whose request has no obtainable destination copies no partial
    page: its plan ends at the last full page, so the host tail is what gets published."""
    b = book(5)
    admit(b)
    second = admit(b, [20, 21, 22, 23, 24, 25])
    b.reserve(Fence(1), [LaneExtent(handle=second.handle, kv_tokens=7)])
    (plan,) = b.reserve(Fence(2), [LaneExtent(handle=second.handle, kv_tokens=7,
                                              snapshot=True)])
    assert isinstance(plan, SnapshotPlan)
    assert (plan.dst_page, plan.kv_tokens, len(plan.page_ids)) == (-1, 4, 1)
    own = b.page_table(second.handle)
    b.release(second.handle, token_ids=[20, 21, 22, 23, 24, 25, 1], kv_tokens=7,
              publish=True, snapshot_done=True)
    b.retire(Fence(2))
    assert b.pages.references(own[1]) == 1  # the host tail went into the cache


def test_queue_28_admission_revokes_an_unused_guard_rather_than_wait() -> None:
    """Four pages: the first request's guard claims the only spare page; a second
    request's budget (mandatory) revokes it and is admitted at once."""
    b = book(4)
    first = admit(b)
    assert guards(b) == 1
    second = b.acquire([20, 21, 22, 23, 24, 25], max_tokens=3)
    assert second is not None
    assert guards(b) == 0 and b.revoked_guards == 1
    assert b.arm_destination(first.handle) is None  # its capture has no destination now


def test_queue_28_a_mandatory_capture_takes_an_unused_guard_but_not_an_armed_one() -> None:
    b = book(5)
    first, second = admit(b), admit(b, [20, 21, 22, 23, 24, 25])
    page = b.arm_destination(second.handle, mandatory=True)  # revokes the first's guard
    assert page is not None and b.revoked_guards == 1
    assert b.arm_destination(first.handle) is None
    # An armed destination is in use: a mandatory capture cannot revoke it.
    c = book(5)
    one, two = admit(c), admit(c, [20, 21, 22, 23, 24, 25])
    assert c.arm_destination(one.handle) is not None
    assert c.arm_destination(two.handle, mandatory=True) is None


def test_queue_29_armed_destination_kept_through_cancellation_until_the_fence() -> None:
    b = book(5)
    grant = admit(b)
    b.reserve(Fence(1), [LaneExtent(handle=grant.handle, kv_tokens=7)])
    (plan,) = b.reserve(Fence(2), [LaneExtent(handle=grant.handle, kv_tokens=7,
                                              snapshot=True)])
    assert isinstance(plan, SnapshotPlan) and plan.dst_page >= 0
    b.retire(Fence(1))
    assert not b.release(grant.handle)  # cancelled while the copy is in flight
    destination = PageId(plan.dst_page)
    assert b.pages.references(destination) == 1
    assert b.statistics().armed_destinations == 1
    b.retire(Fence(2))
    assert b.pages.references(destination) == 0
    assert b.pages.free_count == b.pages.total  # nothing published for a cancel


def test_pre_53_a_continuation_waits_for_the_finishing_requests_publication() -> None:
    """Covers PRE-53, OPEN-35: after ``finishing`` the next turn (its prompt extends the
    finished prompt) is not granted until the finishing request's release is final;
    then it hits the published checkpoint. Unrelated prompts and a repeat of the same
    prompt are not held."""
    b = book(16)
    grant = admit(b, max_tokens=4)
    b.reserve(Fence(1), [LaneExtent(handle=grant.handle, kv_tokens=9)])
    written = [*PROMPT, 40, 41, 42]  # 6 prompt tokens and 3 written outputs
    b.finishing(grant.handle, token_ids=[*written, 43], kv_tokens=9)
    next_turn = [*written, 43, 50, 51]
    assert b.acquire(next_turn, max_tokens=2) is None
    assert b.acquire([1, 2, 3], max_tokens=2) is not None  # unrelated: not held
    assert b.acquire(list(PROMPT), max_tokens=2) is not None  # same prompt: not a turn
    b.release(grant.handle, token_ids=written, kv_tokens=9, publish=True)
    assert b.acquire(next_turn, max_tokens=2) is None  # release waits for fence 1
    b.retire(Fence(1))
    continuation = b.acquire(next_turn, max_tokens=2)
    assert continuation is not None and continuation.cached_tokens == 9


def test_guard_invariant_holds_under_random_lifecycles() -> None:
    """Random acquire / reserve / arm / release / retire: free and evictable pages
    always cover every budget and every unarmed guard; everything returns."""
    rng = random.Random(7)
    b = book(14)
    live: dict[int, tuple[list[int], int, int]] = {}
    in_flight: list[int] = []
    fence = 0
    for _ in range(800):
        action = rng.random()
        if action < 0.3:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(2, 12))]
            max_tokens = rng.randrange(1, 8)
            grant = b.acquire(prompt, max_tokens=max_tokens)
            if grant is not None:  # limit: the worst-case KV extent its budget covers
                live[grant.handle] = (prompt, grant.cached_tokens,
                                      len(prompt) + max_tokens - 1)
        elif action < 0.6 and live:
            handle = rng.choice(list(live))
            tokens, kv, limit = live[handle]
            fence += 1
            snapshot = kv > 0 and rng.random() < 0.3
            if not snapshot:
                kv = min(limit, kv + rng.randrange(1, 5))
            b.reserve(Fence(fence), [LaneExtent(handle=handle, kv_tokens=kv,
                                                snapshot=snapshot)])
            in_flight.append(fence)
            tokens = tokens + [rng.randrange(3) for _ in range(max(kv - len(tokens), 0))]
            live[handle] = (tokens, kv, limit)
        elif action < 0.75 and in_flight:
            b.retire(Fence(in_flight.pop(0)))
        elif live:
            handle = rng.choice(list(live))
            tokens, kv, _ = live.pop(handle)
            b.release(handle, token_ids=tokens[:kv], kv_tokens=kv,
                      publish=rng.random() < 0.7, snapshot_done=rng.random() < 0.5)
        assert b._unguarded_spare() >= 0
    for handle in list(live):
        b.release(handle)
    for f in in_flight:
        b.retire(Fence(f))
    stats = b.statistics()
    assert stats.residents == 0 and stats.destination_guards == 0
    assert stats.armed_destinations == 0
    assert stats.pages_total - stats.pages_free == stats.pages_cached
