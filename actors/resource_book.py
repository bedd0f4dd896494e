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
- **Capture destinations** (seed *Planning and the execution queue*, QUEUE-25,
  QUEUE-27..29, PRE-38, PRE-39; flare's checkpoint "rows" are destination pages, see
  ``docs/runtime.md``, *Checkpoints*). With ``snapshot_lanes > 0`` the last
  ``snapshot_lanes`` state rows are scratch rows (the destination rows of SNAPSHOT
  copies, one per lane of a frame; nothing ever reads them). A request's terminal
  capture copies its partial last page into a destination page:

  - at admission the request gets a *guard* on one spare page for that capture, when
    the pool has a page beyond every budget and every other guard (a guard is a
    claim, not a physical page);
  - a guarded destination is protected from optional captures of other requests:
    an unguarded capture is armed only from spare pages no guard claims (QUEUE-27);
  - mandatory execution may revoke an unused guard: a new request's worst-case
    budget (admission) and a mandatory capture take guarded pages, newest guard
    first, rather than wait (QUEUE-28);
  - a terminal lane's reservation *arms* the destination (takes the page); armed
    destinations stay with the request through its last fence, completion or
    cancellation alike (QUEUE-29). A capture with no obtainable destination is
    reduced to its full pages (no partial copy) and the host path publishes the
    request's own tail (QUEUE-25);
  - when the request is released with ``snapshot_done``, the copied page replaces
    its own partial page in the published chain and the original returns.

  Invariant: ``free + evictable >= outstanding budgets + unarmed guards``.
- **Immediate continuations** (PRE-53, OPEN-35). ``finishing`` records a request
  whose output ended while its terminal capture is still to run; until its release
  is final, an ``acquire`` whose prompt extends that request's whole prompt (the next
  turn of its conversation) is not granted, so the continuation sees the published
  checkpoint even though the client's ``Finished`` came first.
- **Shared prefills** (a request's ``n`` sibling choices). Requests acquired with the
  same non-empty ``prompt_group`` and the same prompt share one prefill: the first
  becomes the group's *leader*; while its prompt's shareable pages (the full pages a
  later lookup may reuse, ``(prompt_len - 1) // page_size`` of them) are not yet
  written, an ``acquire`` of another member is not granted. The leader's prompt pages
  are published as soon as the fence of the frame whose reservation covers them
  retires (not at its release) with none of the leader's lanes rejected, and the
  waiting members are granted with those pages as their cached prefix. A leader that
  ends first (or whose prefill lane was rejected) lets them go once its release is
  final, with whatever it published then.

- **Window snapshots** (PRE-30, PRE-35, PRE-36; ``actors.window_snapshots``). A
  request acquired with ``window_snapshots`` (its images span several windows) is
  granted a second state row, its private snapshot row, and one page more in its
  budget: the destination of its snapshots' partial page, taken at its first
  window boundary and kept until its release. A lane extent with
  ``window_snapshot_at`` gets a ``SnapshotPlan`` into that row. Window snapshots are
  never published and never leave the device: the prefix cache sees only what the
  request's release publishes, as for any request.

Pure bookkeeping: no trio, no device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    guard: int = 0
    """Non-zero while the request holds an unarmed destination guard: the guard's
    sequence number (revocation takes the newest first, QUEUE-28)."""
    snapshot_page: PageId | None = None
    """The armed destination page of its terminal capture (QUEUE-29)."""
    snapshot_kv_tokens: int = 0
    snapshot_done: bool = False
    finishing_tokens: tuple[int, ...] | None = None
    """Its written content once its output ended with the capture still to run
    (PRE-53: continuations of it wait for its publication)."""
    group: tuple[str, tuple[int, ...]] | None = None
    """(prompt group, prompt) while it leads a shared prefill that is not published."""
    group_fence: Fence | None = None
    """The fence after which its shareable prompt pages are written."""
    group_failed: bool = False
    """A lane of its prefill was rejected: it publishes nothing early."""
    snapshot_row: StateRow | None = None
    """Its private window snapshot row (PRE-30)."""
    window_page: PageId | None = None
    """The destination page of its window snapshots' partial page."""
    copy_source: PageId | None = None
    """The cached page its first frame copies into its last prompt page (held till then)."""


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
    destination_guards: int = 0
    """Unarmed destination guards (claims on spare pages, QUEUE-27)."""
    armed_destinations: int = 0
    """Destination pages taken for captures and not yet returned (QUEUE-29)."""
    snapshot_rows: int = 0
    """Private window snapshot rows held by resident requests (PRE-30)."""


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
        self._guard_sequence = 0
        self.revoked_guards = 0
        """Guards taken back by mandatory execution (QUEUE-28), for diagnostics."""
        self.emptied: list[Callable[[], None]] = []
        """Called each time the last resident request's row and pages return."""

    # ------------------------------------------------------------------ admission

    def budget_for(self, prompt_len: int, max_tokens: int) -> int:
        """Worst-case pages: every prompt position and every generated token but the
        last (its KV is never written). A capture destination is a guard, not part
        of the budget."""
        return pages_for(prompt_len + max_tokens - 1, self.page_size)

    def acquire(
        self, prompt: Sequence[int], max_tokens: int, *, message_ends: Sequence[int] = (),
        use_prefix_cache: bool = True, prompt_group: str = "", window_snapshots: bool = False,
        copy_last_page: bool = False,
    ) -> Grant | None:
        """A grant if a row and the request's budget are available now, else None.

        ``prompt_group``: a shared prefill (module docstring); ignored without the
        prefix cache. ``window_snapshots``: it also needs a private snapshot row.
        ``copy_last_page``: a prompt found whole leaves one token uncached, through a
        private copy of its cached last page (``PrefixCache.lookup``, ``Grant.page_copy``)."""
        group = (prompt_group, tuple(prompt)) if prompt_group and use_prefix_cache else None
        if (self.rows.free_count < 1 + window_snapshots or self._continues_a_finishing_request(prompt)
                or (group is not None and self._group_prefilling(group))):
            return None
        # At least one prompt token must run so the first output has logits.
        limit = len(prompt) - 1 if use_prefix_cache else 0
        hit = self.cache.lookup(prompt, limit_tokens=limit, copy_last_page=copy_last_page)
        budget = self.budget_for(len(prompt), max_tokens) - len(hit.pages) + window_snapshots
        if budget > self._available_pages():
            self.cache.give_back(hit)
            return None
        # Admission is mandatory execution: it may revoke unused guards (QUEUE-28).
        self._revoke_guards(budget - self._unguarded_spare())
        row, epoch = self.rows.take()
        handle = RequestHandle(int(row))
        owner = _Ownership(
            handle=handle, epoch=epoch, row=row, pages=list(hit.pages), budget=budget,
            prompt_len=len(prompt), message_ends=tuple(message_ends), copy_source=hit.copy_source,
        )
        if hit.copy_source is not None:
            owner.pages.extend(self._take_pages(owner, 1))
        if window_snapshots:
            owner.snapshot_row = self.rows.take()[0]
        self._owners[handle] = owner
        shareable = (len(prompt) - 1) // self.page_size * self.page_size
        if group is not None and hit.tokens < shareable:
            owner.group = group  # it leads: the others wait for its prompt pages
        if self.terminal_snapshots and self._unguarded_spare() >= 1:
            self._guard_sequence += 1
            owner.guard = self._guard_sequence
        return Grant(handle=handle, epoch=epoch, row=row, cached_pages=tuple(owner.pages),
                     cached_tokens=hit.tokens, snapshot_row=owner.snapshot_row,
                     page_copy=None if hit.copy_source is None else (hit.copy_source, owner.pages[-1]))

    def _available_pages(self) -> int:
        """Pages mandatory work may still claim: free and evictable, less budgets."""
        outstanding = sum(o.budget for o in self._owners.values())
        return self.pages.free_count + self.cache.evictable_count() - outstanding

    def _unguarded_spare(self) -> int:
        """Pages optional captures may take: available pages no guard claims."""
        return self._available_pages() - self._guard_count()

    def _guard_count(self) -> int:
        return sum(1 for o in self._owners.values() if o.guard)

    def _revoke_guards(self, count: int, *, keep: RequestHandle | None = None) -> int:
        """Take back up to ``count`` unused guards, newest first (QUEUE-28)."""
        if count <= 0:
            return 0
        guarded = sorted((o for o in self._owners.values() if o.guard and o.handle != keep),
                         key=lambda o: o.guard, reverse=True)
        for owner in guarded[:count]:
            owner.guard = 0
        self.revoked_guards += len(guarded[:count])
        return len(guarded[:count])

    def _continues_a_finishing_request(self, prompt: Sequence[int]) -> bool:
        """Whether ``prompt`` is the next turn of a request whose output ended and
        whose checkpoint is not published yet: it extends that request's whole
        prompt (OPEN-35). Such an acquisition waits (PRE-53)."""
        for owner in self._owners.values():
            tokens = owner.finishing_tokens
            n = owner.prompt_len
            if tokens is not None and len(prompt) > n and tuple(prompt[:n]) == tokens[:n]:
                return True
        return False

    def _group_prefilling(self, group: tuple[str, tuple[int, ...]]) -> bool:
        return any(o.group == group for o in self._owners.values())

    def _publish_group_prompts(self) -> None:
        """Publish the prompt pages of every leader whose covering fence retired."""
        for owner in self._owners.values():
            fence = owner.group_fence
            if owner.group is None or fence is None or int(fence) > self._retired:
                continue
            shareable = (owner.prompt_len - 1) // self.page_size * self.page_size
            roles = checkpoint_roles(prompt_len=owner.prompt_len,
                                     message_ends=owner.message_ends, kv_tokens=shareable,
                                     page_size=self.page_size, terminal=False)
            self.cache.publish(owner.group[1][:shareable], owner.pages, roles=roles)
            owner.group = None
            owner.group_fence = None

    def finishing(self, handle: RequestHandle, *, token_ids: Sequence[int],
                  kv_tokens: int) -> None:
        """``handle``'s output ended and its client may already have seen
        ``Finished``; its terminal capture and publication are still to come. Until
        then its continuations are held back (PRE-53)."""
        owner = self._owners.get(handle)
        if owner is not None and not owner.released:
            owner.finishing_tokens = tuple(token_ids[:kv_tokens])

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
            if (owner.group is not None and owner.group_fence is None
                    and not owner.group_failed and extent.kv_tokens >= (owner.prompt_len - 1) // self.page_size
                    * self.page_size):
                owner.group_fence = fence
            if extent.snapshot:
                scratch = sum(1 for p in plans if isinstance(p, SnapshotPlan))
                plans.append(self._snapshot_plan(owner, extent.kv_tokens, scratch))
                continue
            if extent.window_snapshot_at is not None:
                plans.append(self._window_snapshot_plan(owner, extent.window_snapshot_at))
            needed = pages_for(extent.kv_tokens, self.page_size) - len(owner.pages)
            if needed <= 0:
                continue
            taken = self._take_pages(owner, needed)
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
            page = self.arm_destination(owner.handle)
            if page is None:
                # No obtainable destination (QUEUE-25): copy the full pages only; the
                # host path will publish the request's own tail.
                kv_tokens -= kv_tokens % self.page_size
                covered = kv_tokens // self.page_size
            else:
                dst = int(page)
        owner.snapshot_kv_tokens = kv_tokens
        return SnapshotPlan(handle=owner.handle, row=owner.row, scratch_row=self.scratch_rows[lane],
                            kv_tokens=kv_tokens, page_ids=tuple(owner.pages[:covered]),
                            dst_page=dst)

    def _window_snapshot_plan(self, owner: _Ownership, kv_tokens: int) -> SnapshotPlan:
        """The request's state at ``kv_tokens`` into its private snapshot row: full
        pages by reference, the partial page into its window page (PRE-37)."""
        covered = pages_for(kv_tokens, self.page_size)
        if owner.snapshot_row is None or covered > len(owner.pages):
            raise ResourceError(f"request {owner.handle} has no private snapshot row or "
                                f"no pages covering {kv_tokens} tokens")
        dst = -1
        if kv_tokens % self.page_size:
            if owner.window_page is None:
                (owner.window_page,) = self._take_pages(owner, 1)
            dst = int(owner.window_page)
        return SnapshotPlan(handle=owner.handle, row=owner.row, scratch_row=owner.snapshot_row,
                            kv_tokens=kv_tokens, page_ids=tuple(owner.pages[:covered]),
                            dst_page=dst)

    def _take_pages(self, owner: _Ownership, needed: int) -> tuple[PageId, ...]:
        """``needed`` pages out of ``owner``'s budget, evicting cache pages if short."""
        if needed > owner.budget:
            raise ResourceError(f"request {owner.handle} needs {needed} pages beyond its budget")
        if needed > self.pages.free_count:
            self.cache.evict(needed - self.pages.free_count)
        owner.budget -= needed
        return self.pages.take(needed)

    def arm_destination(self, handle: RequestHandle, *, mandatory: bool = False
                        ) -> PageId | None:
        """Take the destination page of ``handle``'s terminal capture, or None when
        none is obtainable (QUEUE-25).

        The request's own guard is used first; an unguarded capture takes only spare
        pages no guard claims (QUEUE-27); a ``mandatory`` one may revoke another
        request's unused guard (QUEUE-28). The page stays with the request until its
        release is final (QUEUE-29); arming again returns the same page.
        """
        owner = self._owners.get(handle)
        if owner is None or owner.released:
            raise ResourceError(f"request {handle} is not resident")
        if owner.snapshot_page is not None:
            return owner.snapshot_page
        if owner.guard:
            owner.guard = 0
        elif self._unguarded_spare() < 1 and not (
                mandatory and self._revoke_guards(1, keep=handle) == 1):
            return None
        if self.pages.free_count == 0:
            self.cache.evict(1)
        (owner.snapshot_page,) = self.pages.take(1)
        return owner.snapshot_page

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
        owner.guard = 0  # nothing more is captured for a released request
        if owner.last_fence is None or owner.last_fence <= self._retired:
            self._finalize(owner)
            return True
        return False

    def retire(self, fence: Fence, *, failed: Sequence[RequestHandle] = ()) -> int:
        """``fence`` retired; free every released request whose last fence has.
        ``failed``: requests whose lanes of it were rejected; a shared prefill they lead
        publishes nothing early (its members go once it ends). Returns how many
        requests were freed."""
        self._retired = max(self._retired, int(fence))
        for handle in failed:
            owner = self._owners.get(handle)
            if owner is not None and owner.group is not None:
                owner.group_fence = None
                owner.group_failed = True
        self._publish_group_prompts()
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
                and owner.snapshot_kv_tokens == owner.publish_kv_tokens
                and owner.publish_kv_tokens % self.page_size):
            # The snapshot's copy of the partial page is what gets published; the
            # request's own partial page returns to the pool (PRE-39).
            block = owner.publish_kv_tokens // self.page_size
            owner.pages[block], spare = spare, owner.pages[block]
        owner.snapshot_page = None
        if spare is not None:
            self.pages.drop((spare,))
        if owner.window_page is not None:
            self.pages.drop((owner.window_page,))  # the private snapshot's: never published
        if owner.copy_source is not None:
            self.pages.drop((owner.copy_source,))
        if owner.snapshot_row is not None:
            self.rows.give_back(owner.snapshot_row)
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
        if not self._owners:
            for listener in tuple(self.emptied):
                listener()

    # ------------------------------------------------------------------ views

    def owns(self, handle: RequestHandle) -> bool:
        return handle in self._owners

    def page_table(self, handle: RequestHandle) -> tuple[PageId, ...]:
        return tuple(self._owners[handle].pages)

    def page_use(self) -> tuple[int, int]:
        """``(pages in use by requests, pages held by the prefix cache alone)``: together
        every taken page; a cached page a request shares counts as in use."""
        cached_only = self.cache.evictable_count()
        return self.pages.used_count - cached_only, cached_only

    def statistics(self) -> ResourceStatistics:
        cache = self.cache.statistics()
        return ResourceStatistics(
            pages_total=self.pages.total, pages_free=self.pages.free_count,
            pages_cached=cache.pages, rows_total=self.rows.total,
            rows_free=self.rows.free_count, residents=len(self._owners),
            pending_releases=sum(1 for o in self._owners.values() if o.released),
            prefix_hit_tokens=cache.hit_tokens, destination_guards=self._guard_count(),
            armed_destinations=sum(1 for o in self._owners.values()
                                   if o.snapshot_page is not None),
            snapshot_rows=sum(1 for o in self._owners.values() if o.snapshot_row is not None),
        )
