"""The checkpoint-allocator's synchronous core: who owns which row and pages, and when
they come back.

Owns (architecture step 7; seed *Planning and the execution queue*, QUEUE-9, QUEUE-29,
QUEUE-49/50, PRE-39, PRE-54):

- **Grants.** A request becomes resident only with a state row and a page *budget*
  covering its worst case (prompt plus ``max_tokens``) less the pages its cached
  prefix shares. A resident request therefore never runs out of pages mid-stream and
  nothing is ever preempted (OPEN-3: preemption is charged to nobody because it does
  not happen; waiting requests queue in admission instead). Pages are taken from the
  budget lazily, frame by frame (``reserve``), evicting unreferenced cache pages when
  the free list is short.
- **Fenced retirement.** ``release`` records the request's last submitted fence; its
  row and pages return only once that fence has retired (frames retire in FIFO order
  on the one stream, so a watermark suffices). Publication into the prefix cache
  happens at the same moment, so only written pages are ever shared.
- **Accounting.** ``free_pages + evictable`` covers every outstanding budget, which
  ``acquire`` maintains as an invariant.
- **Terminal snapshots** (``snapshot_lanes > 0``; seed *Prerequisites and
  completion*, PRE-38, PRE-39). The last ``snapshot_lanes`` state rows are kept as
  scratch rows (the destination rows of SNAPSHOT copies, one per lane of a frame;
  nothing ever reads them), and every
  budget holds one more page: the snapshot destination for the partial last page.
  A terminal snapshot lane's reservation (``LaneExtent(snapshot=True)``) takes that
  page; when the request is released with ``snapshot_done``, the copied page replaces
  its own partial page in the published chain and the original returns to the pool.

Pure bookkeeping: no trio, no device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from actors.checkpoints import checkpoint_roles
from actors.messages import (
    Fence,
    Grant,
    LaneExtent,
    PageId,
    PagePlan,
    RequestHandle,
    SnapshotPlan,
    StateRow,
)
from actors.page_pool import PagePool, ResourceError, StateRowPool, pages_for
from actors.prefix_cache import PrefixCache


@dataclass(slots=True, kw_only=True)
class _Ownership:
    handle: RequestHandle
    epoch: int
    row: StateRow
    pages: list[PageId]
    budget: int
    """Pages this request may still take."""
    prompt_len: int
    last_fence: Fence | None = None
    released: bool = False
    publish_tokens: tuple[int, ...] = ()
    publish_kv_tokens: int = 0
    publish: bool = False
    message_ends: tuple[int, ...] = field(default=())
    snapshot_page: PageId | None = None
    """The terminal snapshot's destination page (written once its fence retires)."""
    snapshot_kv_tokens: int = 0
    snapshot_done: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceStatistics:
    pages_total: int
    pages_free: int
    pages_cached: int
    rows_total: int
    rows_free: int
    residents: int
    pending_releases: int
    prefix_hit_tokens: int


class ResourceBook:
    """Rows, page budgets, the prefix cache and fenced retirement."""

    def __init__(self, *, num_pages: int, state_rows: int, page_size: int,
                 snapshot_lanes: int = 0) -> None:
        self.page_size = page_size
        self.pages = PagePool(num_pages)
        self.terminal_snapshots = snapshot_lanes > 0
        if state_rows <= snapshot_lanes:
            raise ResourceError(f"{state_rows} state rows leave none for requests beside "
                                f"{snapshot_lanes} snapshot scratch rows")
        state_rows -= snapshot_lanes
        self.scratch_rows = tuple(StateRow(state_rows + i) for i in range(snapshot_lanes))
        self.rows = StateRowPool(state_rows)
        self.cache = PrefixCache(self.pages, page_size)
        self._owners: dict[RequestHandle, _Ownership] = {}
        self._retired: int = 0
        """Every fence up to and including this one has retired."""

    # ------------------------------------------------------------------ admission

    def budget_for(self, prompt_len: int, max_tokens: int) -> int:
        """Worst-case pages: every prompt position and every generated token but the
        last (its KV is never written), plus the snapshot destination when terminal
        snapshots run."""
        extra = 1 if self.terminal_snapshots else 0
        return pages_for(prompt_len + max_tokens - 1, self.page_size) + extra

    def acquire(
        self, prompt: Sequence[int], max_tokens: int, *, message_ends: Sequence[int] = (),
        use_prefix_cache: bool = True,
    ) -> Grant | None:
        """A grant if a row and the request's budget are available now, else None."""
        if self.rows.free_count == 0:
            return None
        # At least one prompt token must run so the first output has logits.
        limit = len(prompt) - 1 if use_prefix_cache else 0
        hit = self.cache.lookup(prompt, limit_tokens=limit)
        budget = self.budget_for(len(prompt), max_tokens) - len(hit.pages)
        if budget > self._available_pages():
            self.cache.give_back(hit)
            return None
        row, epoch = self.rows.take()
        handle = RequestHandle(int(row))
        self._owners[handle] = _Ownership(
            handle=handle, epoch=epoch, row=row, pages=list(hit.pages), budget=budget,
            prompt_len=len(prompt), message_ends=tuple(message_ends),
        )
        return Grant(handle=handle, epoch=epoch, row=row, cached_pages=hit.pages,
                     cached_tokens=hit.tokens)

    def _available_pages(self) -> int:
        outstanding = sum(o.budget for o in self._owners.values())
        return self.pages.free_count + self.cache.evictable_count() - outstanding

    # ------------------------------------------------------------------ frames

    def reserve(self, fence: Fence, extents: Sequence[LaneExtent]
                ) -> tuple[PagePlan | SnapshotPlan, ...]:
        """Give each lane pages covering its KV extent after ``fence`` and pin the
        request's resources through ``fence`` (QUEUE-49, QUEUE-50). A snapshot lane
        gets its ``SnapshotPlan`` instead."""
        plans: list[PagePlan | SnapshotPlan] = []
        for extent in extents:
            owner = self._owners.get(extent.handle)
            if owner is None or owner.released:
                raise ResourceError(f"request {extent.handle} is not resident")
            owner.last_fence = fence
            if extent.snapshot:
                scratch = sum(1 for p in plans if isinstance(p, SnapshotPlan))
                plans.append(self._snapshot_plan(owner, extent.kv_tokens, scratch))
                continue
            needed = pages_for(extent.kv_tokens, self.page_size) - len(owner.pages)
            if needed <= 0:
                continue
            if needed > owner.budget:
                raise ResourceError(
                    f"request {extent.handle} needs {needed} pages beyond its budget"
                )
            if needed > self.pages.free_count:
                self.cache.evict(needed - self.pages.free_count)
            taken = self.pages.take(needed)
            owner.budget -= needed
            plans.append(PagePlan(handle=extent.handle, row=owner.row,
                                  first_block=len(owner.pages), page_ids=taken))
            owner.pages.extend(taken)
        return tuple(plans)

    def _snapshot_plan(self, owner: _Ownership, kv_tokens: int, lane: int) -> SnapshotPlan:
        if lane >= len(self.scratch_rows):
            raise ResourceError(f"snapshot lane {lane}: this book keeps "
                                f"{len(self.scratch_rows)} scratch rows")
        covered = pages_for(kv_tokens, self.page_size)
        if covered > len(owner.pages):
            raise ResourceError(f"request {owner.handle} holds {len(owner.pages)} pages, "
                                f"a snapshot at {kv_tokens} tokens needs {covered}")
        dst = -1
        if kv_tokens % self.page_size:
            if owner.snapshot_page is None:
                if owner.budget < 1:
                    raise ResourceError(f"request {owner.handle} has no snapshot page left")
                if self.pages.free_count == 0:
                    self.cache.evict(1)
                (owner.snapshot_page,) = self.pages.take(1)
                owner.budget -= 1
            dst = int(owner.snapshot_page)
        owner.snapshot_kv_tokens = kv_tokens
        return SnapshotPlan(handle=owner.handle, row=owner.row, scratch_row=self.scratch_rows[lane],
                            kv_tokens=kv_tokens, page_ids=tuple(owner.pages[:covered]),
                            dst_page=dst)

    def pin(self, fence: Fence, handles: Sequence[RequestHandle]) -> None:
        """Pin requests that take part in ``fence`` without needing pages."""
        for handle in handles:
            owner = self._owners.get(handle)
            if owner is not None and not owner.released:
                owner.last_fence = fence

    # ------------------------------------------------------------------ retirement

    def release(
        self,
        handle: RequestHandle,
        *,
        token_ids: Sequence[int] = (),
        kv_tokens: int = 0,
        publish: bool = False,
        snapshot_done: bool = False,
    ) -> bool:
        """The request will submit nothing more. Returns True if its resources came
        back at once (its last fence had already retired)."""
        owner = self._owners.get(handle)
        if owner is None or owner.released:
            return False
        owner.released = True
        owner.publish = publish
        owner.publish_tokens = tuple(token_ids)
        owner.publish_kv_tokens = kv_tokens
        owner.snapshot_done = snapshot_done
        owner.budget = 0
        if owner.last_fence is None or owner.last_fence <= self._retired:
            self._finalize(owner)
            return True
        return False

    def retire(self, fence: Fence) -> int:
        """``fence`` retired; free every released request whose last fence has.
        Returns how many requests were freed."""
        self._retired = max(self._retired, int(fence))
        done = [
            o for o in self._owners.values()
            if o.released and (o.last_fence is None or o.last_fence <= self._retired)
        ]
        for owner in done:
            self._finalize(owner)
        return len(done)

    def _finalize(self, owner: _Ownership) -> None:
        spare = owner.snapshot_page
        if (spare is not None and owner.snapshot_done and owner.publish
                and owner.snapshot_kv_tokens == owner.publish_kv_tokens):
            # The snapshot's copy of the partial page is what gets published; the
            # request's own partial page returns to the pool (PRE-39).
            block = owner.publish_kv_tokens // self.page_size
            owner.pages[block], spare = spare, owner.pages[block]
        owner.snapshot_page = None
        if spare is not None:
            self.pages.drop((spare,))
        if owner.publish and owner.publish_kv_tokens > 0:
            kv = owner.publish_kv_tokens
            roles = checkpoint_roles(
                prompt_len=owner.prompt_len, message_ends=owner.message_ends,
                kv_tokens=kv, page_size=self.page_size, terminal=True,
            )
            self.cache.publish(owner.publish_tokens[:kv], owner.pages, roles=roles)
        self.pages.drop(owner.pages)
        owner.pages = []
        self.rows.give_back(owner.row)
        del self._owners[owner.handle]

    # ------------------------------------------------------------------ views

    def owns(self, handle: RequestHandle) -> bool:
        return handle in self._owners

    def page_table(self, handle: RequestHandle) -> tuple[PageId, ...]:
        return tuple(self._owners[handle].pages)

    def statistics(self) -> ResourceStatistics:
        cache = self.cache.statistics()
        return ResourceStatistics(
            pages_total=self.pages.total, pages_free=self.pages.free_count,
            pages_cached=cache.pages, rows_total=self.rows.total,
            rows_free=self.rows.free_count, residents=len(self._owners),
            pending_releases=sum(1 for o in self._owners.values() if o.released),
            prefix_hit_tokens=cache.hit_tokens,
        )
