"""The prefix cache: full KV pages shared by reference, keyed by token content.

Owns the decisions of seed *Planning and the execution queue* (checkpoint retention)
and OPEN-3 as ``docs/runtime.md`` states them:

- **Keys.** A cached page is a node of a trie: its key is (parent node, the page's
  ``page_size`` token ids), so equal content under an equal prefix is one node, and a
  hit is the longest chain of full pages matching a prompt. Attention KV at a
  position depends only on the tokens up to it, so a full page is a complete,
  immutable checkpoint of its span.
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


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHit:
    """A lookup result: the shared pages (already referenced for the caller)."""

    pages: tuple[PageId, ...]
    tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheStatistics:
    pages: int
    evictable_pages: int
    hits: int
    hit_tokens: int
    evictions: int


class PrefixCache:
    """Token-content-keyed full pages, reference-counted in a shared ``PagePool``."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self._pool = pool
        self.page_size = page_size
        self._nodes: dict[tuple[int, tuple[int, ...]], _Node] = {}
        self._next_id = 1
        self._demand = 0
        self._hits = 0
        self._hit_tokens = 0
        self._evictions = 0

    # ------------------------------------------------------------------ lookups

    def lookup(self, token_ids: Sequence[int], *, limit_tokens: int) -> PrefixHit:
        """The longest cached chain of full pages within ``limit_tokens``; each page
        gains one reference for the caller, who must ``PagePool.drop`` them later."""
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
        if pages:
            self._hits += 1
            self._hit_tokens += len(pages) * self.page_size
        return PrefixHit(pages=tuple(pages), tokens=len(pages) * self.page_size)

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
                self._pool.share([node.page])
                if parent is not None:
                    parent.children += 1
                added += 1
            else:
                node.role = max(node.role, role)
                node.last_demand = self._demand
            parent = node
        return added

    # ------------------------------------------------------------------ eviction

    def evictable_count(self) -> int:
        """Pages the cache alone holds (each can be freed, leaves first)."""
        return sum(1 for n in self._nodes.values() if self._pool.references(n.page) == 1)

    def victim_order_key(self, node: _Node) -> tuple[int, int, int]:
        """Smaller sorts first: least recent demand, weakest role, longest endpoint."""
        return (node.last_demand, int(node.role), -node.depth)

    def evict(self, pages_needed: int) -> int:
        """Free up to ``pages_needed`` pages by evicting victims; return pages freed."""
        freed = 0
        while freed < pages_needed:
            leaves = [
                n for n in self._nodes.values()
                if n.children == 0 and self._pool.references(n.page) == 1
            ]
            if not leaves:
                break
            victim = min(leaves, key=self.victim_order_key)
            del self._nodes[victim.key]
            if victim.parent is not None:
                victim.parent.children -= 1
            freed += self._pool.drop([victim.page])
            self._evictions += 1
        return freed

    def clear(self) -> None:
        """Drop every cached page reference (shutdown)."""
        for node in self._nodes.values():
            self._pool.drop([node.page])
        self._nodes.clear()

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            pages=len(self._nodes), evictable_pages=self.evictable_count(), hits=self._hits,
            hit_tokens=self._hit_tokens, evictions=self._evictions,
        )
