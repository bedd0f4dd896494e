"""The KV page pool and the state-row pool: the checkpoint-allocator's raw resources.

``PagePool`` hands out page ids with reference counts, because a full page can be
shared by reference between the prefix cache and any number of requests (OPEN-3,
alias awareness: a page returns to the free list only when its last reference goes).
``StateRowPool`` hands out device request-state rows; a row is a request's slot, so a
reused row always comes back with a larger epoch (ACCT-5).

Pure bookkeeping: no trio, no device. Misuse (double free, unknown page) raises
``ResourceError`` at once rather than corrupting the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from actors.messages import PageId, StateRow


class ResourceError(RuntimeError):
    """Raised on a bookkeeping violation (freeing a free page, unknown row); a bug."""


class PagePool:
    """Reference-counted KV pages ``0..num_pages-1``."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page")
        self.total = num_pages
        self._free: deque[PageId] = deque(PageId(i) for i in range(num_pages))
        self._refs: dict[PageId, int] = {}

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.total - len(self._free)

    def references(self, page: PageId) -> int:
        return self._refs.get(page, 0)

    def take(self, count: int) -> tuple[PageId, ...]:
        """Take ``count`` free pages with one reference each."""
        if count > len(self._free):
            raise ResourceError(f"asked for {count} pages, {len(self._free)} free")
        pages = tuple(self._free.popleft() for _ in range(count))
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: Iterable[PageId]) -> None:
        """Add one reference to each (already taken) page."""
        for page in pages:
            if page not in self._refs:
                raise ResourceError(f"page {page} is not taken")
            self._refs[page] += 1

    def drop(self, pages: Iterable[PageId]) -> int:
        """Remove one reference from each page; return how many became free."""
        freed = 0
        for page in pages:
            refs = self._refs.get(page, 0)
            if refs <= 0:
                raise ResourceError(f"page {page} dropped more often than taken")
            if refs == 1:
                del self._refs[page]
                self._free.append(page)
                freed += 1
            else:
                self._refs[page] = refs - 1
        return freed


class StateRowPool:
    """Device request-state rows; each take bumps a global generation (epoch)."""

    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError("the state-row pool needs at least one row")
        self.total = rows
        self._free: deque[StateRow] = deque(StateRow(i) for i in range(rows))
        self._taken: set[StateRow] = set()
        self._next_epoch = 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._taken)

    def take(self) -> tuple[StateRow, int]:
        """A free row and a fresh epoch, larger than every earlier one (ACCT-5)."""
        if not self._free:
            raise ResourceError("no free state row")
        row = self._free.popleft()
        self._taken.add(row)
        epoch = self._next_epoch
        self._next_epoch += 1
        return row, epoch

    def give_back(self, row: StateRow) -> None:
        if row not in self._taken:
            raise ResourceError(f"state row {row} is not taken")
        self._taken.remove(row)
        self._free.append(row)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` KV positions."""
    return -(-tokens // page_size) if tokens > 0 else 0
