"""``ResourceBook.emptied``: listeners hear the moment the last resident request's row
and pages return (what tests await instead of polling the statistics)."""

from __future__ import annotations

from actors.messages import LaneExtent
from actors.resource_book import ResourceBook
from policy.types import Fence


def test_listeners_run_when_the_last_resident_leaves() -> None:
    book = ResourceBook(num_pages=16, state_rows=4, page_size=4)
    heard: list[int] = []
    book.emptied.append(lambda: heard.append(book.statistics().residents))
    first = book.acquire([1, 2, 3], max_tokens=4)
    second = book.acquire([4, 5, 6], max_tokens=4)
    assert first is not None and second is not None
    book.reserve(Fence(1), [LaneExtent(handle=second.handle, kv_tokens=3)])
    assert book.release(first.handle)
    assert heard == []  # one resident is left
    assert not book.release(second.handle)  # fence 1 still in flight
    assert heard == []
    book.retire(Fence(1))
    assert heard == [0]
