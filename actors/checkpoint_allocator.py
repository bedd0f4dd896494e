"""checkpoint-allocator: the actor that owns the page pool, state rows, prefix cache and
fenced retirement (architecture step 7).

The decisions are ``ResourceBook``'s (``actors/resource_book.py``); this actor only
serialises access to it. Requests that cannot be granted yet are parked in FIFO order
and granted as soon as retirement frees enough (admission keeps at most one request
parked here, so the bounded queue stays in admission where ``QueueFull`` is decided).
Every reply goes to a one-shot channel of size one, so replying never blocks.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import TypeVar

import trio

from actors.messages import (
    Acquire,
    AllocatorInbox,
    CancelAcquire,
    FenceRetired,
    Finishing,
    Release,
    Reserve,
)
from actors.resource_book import ResourceBook

T = TypeVar("T")


def _reply(channel: trio.MemorySendChannel[T], value: T) -> None:
    # The asker may have stopped waiting (shutdown).
    with channel, contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        channel.send_nowait(value)


class AllocatorState:
    """The book plus the parked acquisitions, driven one message at a time."""

    def __init__(self, book: ResourceBook) -> None:
        self.book = book
        self.parked: deque[Acquire] = deque()

    def handle(self, msg: AllocatorInbox) -> None:
        if isinstance(msg, Acquire):
            self.parked.append(msg)
        elif isinstance(msg, CancelAcquire):
            for parked in list(self.parked):
                if parked.request_id == msg.request_id:
                    self.parked.remove(parked)
                    _reply(parked.reply, None)
        elif isinstance(msg, Reserve):
            _reply(msg.reply, self.book.reserve(msg.fence, msg.extents))
        elif isinstance(msg, Release):
            self.book.release(msg.handle, token_ids=msg.token_ids, kv_tokens=msg.kv_tokens,
                              publish=msg.publish, snapshot_done=msg.snapshot_done)
        elif isinstance(msg, Finishing):
            self.book.finishing(msg.handle, token_ids=msg.token_ids, kv_tokens=msg.kv_tokens)
        elif isinstance(msg, FenceRetired):
            self.book.retire(msg.fence, failed=msg.failed)
        self._grant_parked()

    def _grant_parked(self) -> None:
        while self.parked:
            head = self.parked[0]
            grant = self.book.acquire(head.prompt_token_ids, head.max_tokens,
                                      message_ends=head.message_ends,
                                      use_prefix_cache=head.use_prefix_cache,
                                      prompt_group=head.prompt_group,
                                      window_snapshots=head.window_snapshots,
                                      copy_last_page=head.copy_last_page)
            if grant is None:
                return
            self.parked.popleft()
            _reply(head.reply, grant)

    def close(self) -> None:
        while self.parked:
            _reply(self.parked.popleft().reply, None)


async def run(
    inbox: trio.MemoryReceiveChannel[AllocatorInbox],
    *,
    state: AllocatorState,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until every sender (admission, planner, validator) has closed its end."""
    async with inbox:
        task_status.started()
        try:
            async for msg in inbox:
                state.handle(msg)
        finally:
            state.close()
