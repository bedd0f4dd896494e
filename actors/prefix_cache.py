"""The prefix cache: full KV pages shared by reference, keyed by token content.

Owns the decisions of seed *Planning and the execution queue* (checkpoint retention)
and OPEN-3 as ``docs/runtime.md`` states them:

- **Keys.** A cached page is a node of a trie: its key is (parent node, the page's
  ``page_size`` token ids), so equal content under an equal prefix is one node, and a
  hit is the longest chain of full pages matching a prompt. Attention KV at a
  position depends only on the tokens up to it, so a full page is a complete,
  immutable checkpoint of its span.
- **Partial tails.** The partial last page of a finished request is no longer written
  by anyone, so it is kept as it is (zero copy), keyed by (parent node, its tokens).
  A hit *moves* it to the request that reuses it, which will write the rest of that
  page: only an unshared tail can be taken, and the cache forgets it (the taker
  publishes its own pages when it finishes). A taker whose prompt diverges inside the
  tail takes it too, truncated to the common prefix (KV at a position depends only on
  the tokens up to it, so the tail's first ``k`` positions are the taker's own; it
  overwrites the rest). This is how a conversation anchor inside the last page of a
  short exchange is reused by a turn that shares the anchor but not the answer
  (QUEUE-17).
- **A private copy of the last page.** A lookup with ``copy_last_page`` that stops
  short of its limit looks under the last matched node for a cached page (full, or a
  tail someone shares) whose tokens begin with the rest of the prompt: a prompt found
  whole in the cache, whose last page holds the previous request's later tokens too.
  The hit names it as ``copy_source`` (referenced for the caller, who copies it into a
  page of its own before anything reads that, ``gpu.frames.PageCopy``) and reaches the
  limit: the copy's first positions are the caller's own KV, and it overwrites the rest.
- **Publication.** Pages enter the cache only after the frame that wrote them retired
  (the caller's job: ``ResourceBook`` publishes on fence retirement). Inserting a page
  whose node already exists keeps the existing page (the request's duplicate is freed
  with the request): one physical page per content.
- **Alias awareness.** The cache holds one ``PagePool`` reference per node. A node is
  evictable only when the cache's reference is the page's last one (no resident
  request shares it) and it has no cached children. Because requests share prefixes
  from the root, every descendant of an evictable node is evictable too.
- **Victims** (QUEUE-30) are ranked by demand recency first (least recently looked up
  or published), then checkpoint role (interior pages before prompt ends, before
  message anchors, before terminal snapshots), then endpoint length (longer first,
  so shared short prefixes outlive their extensions).

Pure and synchronous; recency is a logical counter, not a clock.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from actors.messages import PageId
from actors.page_pool import PagePool


class CheckpointRole(enum.IntEnum):
    """Why a page ends a checkpoint; a higher value is kept longer (QUEUE-30)."""

    INTERIOR = 0
    PROMPT_END = 1
    MESSAGE = 2
    TERMINAL = 3


@dataclass(slots=True, eq=False)
class _Node:
    key: tuple[int, tuple[int, ...]]
    page: PageId
    parent: _Node | None
    depth: int
    """Number of full pages up to and including this one."""
    role: CheckpointRole
    last_demand: int
    children: int = 0
    node_id: int = field(default=0)
    partial: bool = False
    """A last page holding fewer than ``page_size`` tokens (never a parent)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHit:
    """A lookup result: the shared pages (already referenced for the caller)."""

    pages: tuple[PageId, ...]
    tokens: int
    tail: _Node | None = None
    """The partial tail moved to the caller, if any (``give_back`` can return it)."""
    copy_source: PageId | None = None
    """A cached page the caller copies into its own last page (``copy_last_page``); it is
    not in ``pages``, and its reference is the caller's to drop after the copy ran."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheStatistics:
    pages: int
    evictable_pages: int
    hits: int
    hit_tokens: int
    evictions: int


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Token-content-keyed full pages, reference-counted in a shared ``PagePool``."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self._pool = pool
        self.page_size = page_size
        self._nodes: dict[tuple[int, tuple[int, ...]], _Node] = {}
        self._children: dict[int, list[_Node]] = {}
        """Cached pages (full and partial) by parent node id (0: the root)."""
        self._next_id = 1
        self._demand = 0
        self._hits = 0
        self._hit_tokens = 0
        self._evictions = 0

    # ------------------------------------------------------------------ lookups

    def lookup(self, token_ids: Sequence[int], *, limit_tokens: int,
               copy_last_page: bool = False) -> PrefixHit:
        """The longest cached chain of full pages within ``limit_tokens``; each page
        gains one reference for the caller, who must ``PagePool.drop`` them later.
        ``copy_last_page``: reach the limit through a page to copy where one matches."""
        self._demand += 1
        pages: list[PageId] = []
        parent_id = 0
        for start in range(0, limit_tokens - self.page_size + 1, self.page_size):
            node = self._nodes.get((parent_id, tuple(token_ids[start:start + self.page_size])))
            if node is None:
                break
            node.last_demand = self._demand
            pages.append(node.page)
            parent_id = node.node_id
        self._pool.share(pages)
        tokens = len(pages) * self.page_size
        tail, common = self._take_partial(parent_id, token_ids[tokens:limit_tokens])
        if tail is not None:
            pages.append(tail.page)  # the cache's reference moves to the caller
            tokens += common
        source = None
        if copy_last_page and tail is None and tokens < limit_tokens:
            source = self._copy_source(parent_id, token_ids[tokens:limit_tokens])
            if source is not None:
                self._pool.share([source])
                tokens = limit_tokens
        if tokens:
            self._hits += 1
            self._hit_tokens += tokens
        return PrefixHit(pages=tuple(pages), tokens=tokens, tail=tail, copy_source=source)

    def _copy_source(self, parent_id: int, rest: Sequence[int]) -> PageId | None:
        """A cached page under ``parent_id`` whose tokens begin with ``rest`` (shorter
        than a page), the most recently demanded one."""
        want = tuple(rest)
        found = [n for n in self._children.get(parent_id, ()) if n.key[1][:len(want)] == want]
        if not found:
            return None
        best = max(found, key=lambda n: n.last_demand)
        best.last_demand = self._demand
        return best.page

    def give_back(self, hit: PrefixHit) -> None:
        """Undo ``lookup`` for a caller that could not use it: drop the shared pages'
        references and put a moved tail back into the cache."""
        shared = hit.pages[:-1] if hit.tail is not None else hit.pages
        self._pool.drop(shared)
        if hit.copy_source is not None:
            self._pool.drop([hit.copy_source])
        if hit.tail is not None:
            node = hit.tail
            self._nodes[node.key] = node
            self._children.setdefault(node.key[0], []).append(node)
            if node.parent is not None:
                node.parent.children += 1
        if hit.tokens:
            self._hits -= 1
            self._hit_tokens -= hit.tokens

    def _take_partial(self, parent_id: int, rest: Sequence[int]
                      ) -> tuple[_Node | None, int]:
        """Remove and return the partial tail under ``parent_id`` that shares the
        longest common prefix (at least one token) with ``rest`` and that no request
        shares, with that prefix's length (move on reuse: the taker writes the rest of
        that page from there, so it must own it alone)."""
        best: _Node | None = None
        best_common = 0
        for node in self._children.get(parent_id, ()):
            if not node.partial or self._pool.references(node.page) != 1:
                continue
            common = _common_prefix(node.key[1], rest)
            if common > best_common:
                best, best_common = node, common
        if best is not None:
            self._forget(best)
        return best, best_common

    def _forget(self, node: _Node) -> None:
        """Unlink ``node`` (its page reference is the caller's business)."""
        del self._nodes[node.key]
        siblings = self._children[node.key[0]]
        siblings.remove(node)
        if not siblings:
            del self._children[node.key[0]]
        if node.parent is not None:
            node.parent.children -= 1

    # ------------------------------------------------------------------ publication

    def publish(
        self,
        token_ids: Sequence[int],
        pages: Sequence[PageId],
        *,
        roles: dict[int, CheckpointRole] | None = None,
    ) -> int:
        """Insert the full pages of ``token_ids`` (``pages[i]`` holds page ``i``).

        ``roles`` maps a page index to the checkpoint role ending there; a node keeps
        the highest role it was ever published with. Returns the pages added.
        """
        self._demand += 1
        roles = roles or {}
        added = 0
        parent: _Node | None = None
        full = min(len(token_ids) // self.page_size, len(pages))
        for index in range(full):
            chunk = tuple(token_ids[index * self.page_size:(index + 1) * self.page_size])
            key = (parent.node_id if parent else 0, chunk)
            role = roles.get(index, CheckpointRole.INTERIOR)
            node = self._nodes.get(key)
            if node is None:
                node = _Node(key=key, page=pages[index], parent=parent, depth=index + 1,
                             role=role, last_demand=self._demand, node_id=self._next_id)
                self._next_id += 1
                self._nodes[key] = node
                self._children.setdefault(key[0], []).append(node)
                self._pool.share([node.page])
                if parent is not None:
                    parent.children += 1
                added += 1
            else:
                node.role = max(node.role, role)
                node.last_demand = self._demand
            parent = node
        rest = tuple(token_ids[full * self.page_size:])
        if full == len(token_ids) // self.page_size and rest and len(pages) > full:
            added += self._publish_partial(parent, rest, pages[full],
                                           roles.get(full, CheckpointRole.INTERIOR))
        return added

    def _publish_partial(self, parent: _Node | None, chunk: tuple[int, ...], page: PageId,
                         role: CheckpointRole) -> int:
        """Keep a written, no-longer-written partial last page (zero copy)."""
        parent_id = parent.node_id if parent else 0
        key = (parent_id, chunk)
        existing = self._nodes.get(key)
        if existing is not None:
            existing.role = max(existing.role, role)
            existing.last_demand = self._demand
            return 0
        node = _Node(key=key, page=page, parent=parent, depth=(parent.depth if parent else 0),
                     role=role, last_demand=self._demand, node_id=self._next_id,
                     partial=True)
        self._next_id += 1
        self._nodes[key] = node
        self._children.setdefault(parent_id, []).append(node)
        if parent is not None:
            parent.children += 1  # a node with a cached tail is not a leaf
        self._pool.share([page])
        return 1

    # ------------------------------------------------------------------ eviction

    def evictable_count(self) -> int:
        """Pages the cache alone holds (each can be freed, leaves first)."""
        return sum(1 for n in self._nodes.values() if self._pool.references(n.page) == 1)

    def victim_order_key(self, node: _Node) -> tuple[int, int, int]:
        """Smaller sorts first: least recent demand, weakest role, longest endpoint
        (a partial tail ends after its parent's full pages)."""
        endpoint = node.depth * self.page_size + (len(node.key[1]) if node.partial else 0)
        return (node.last_demand, int(node.role), -endpoint)

    def evict(self, pages_needed: int) -> int:
        """Free up to ``pages_needed`` pages by evicting victims; return pages freed.

        One scan builds a heap of evictable leaves; a parent joins it when its last
        child goes (keys do not change during an eviction).
        """
        def evictable_leaf(node: _Node) -> bool:
            return node.children == 0 and self._pool.references(node.page) == 1

        heap = [(self.victim_order_key(n), n.node_id, n) for n in self._nodes.values()
                if evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < pages_needed and heap:
            _, _, victim = heapq.heappop(heap)
            self._forget(victim)
            freed += self._pool.drop([victim.page])
            self._evictions += 1
            parent = victim.parent
            if parent is not None and evictable_leaf(parent):
                heapq.heappush(heap, (self.victim_order_key(parent), parent.node_id, parent))
        return freed

    def clear(self) -> None:
        """Drop every cached page reference (shutdown)."""
        for node in self._nodes.values():
            self._pool.drop([node.page])
        self._nodes.clear()
        self._children.clear()

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            pages=len(self._nodes), evictable_pages=self.evictable_count(), hits=self._hits,
            hit_tokens=self._hit_tokens, evictions=self._evictions,
        )
