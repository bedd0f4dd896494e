"""The two-slot execution window (seed: *Planning and the execution queue*).

This module owns what is in flight: each committed frame with its frozen plan,
participants, expected service and expected finish time, and the gate that says whether
a plan may be submitted now.

- Two frame slots (QUEUE-10). Only ordinary decode and complete speculative generation
  may occupy both (QUEUE-11): a frame may be queued behind another only when both are
  generation programs whose plans need no completion feedback. Prefill, scored prefill,
  mixed, vision and state operations drain the window (QUEUE-12, MIX-31), as do unknown
  or stale costs and exploration plans (QUEUE-13, DUR-25, DUR-27, QUEUE-36).
- Expected finish times give an appended frame its planning start (QUEUE-38); there is
  no millisecond cap on a frame or on the queue (QUEUE-37).
- Overrun (OPEN-31): a frame still running when ``advance_to`` passes its expected
  finish. It suspends further queueing until a completion supplies feedback (QUEUE-39);
  it never makes the graph ineligible (QUEUE-40).

Pure: no clocks; times come from ``Scheduler.advance_to``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

from policy.service import Normalizers
from policy.types import Fence, RequestHandle, ScheduledPlan, SelectionReason

FRAME_SLOTS = 2
"""The transport's frame slots (QUEUE-10)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuedFrame:
    """One committed, not yet completed frame.

    ``participants``: resident runnable handles and epochs at commit (ACCT-1).
    ``isolated``: nothing else was in flight at commit (ACCT-9/10, REF-3/4).
    ``expected_start_ns``/``expected_end_ns``: its planning interval (QUEUE-38).
    ``reason``: the execution-counter kind, fixed at commit.
    """

    fence: Fence
    plan: ScheduledPlan
    committed_ns: int
    expected_start_ns: int
    expected_end_ns: int
    isolated: bool
    participants: tuple[tuple[RequestHandle, int], ...]
    normalizers: Normalizers
    reason: SelectionReason


class FrameQueue:
    """The frames in flight, oldest first."""

    def __init__(self) -> None:
        self._frames: deque[QueuedFrame] = deque()
        self._overrun = False
        self.last_completed_ns = 0
        """When the latest completion was popped (``pop``'s ``now_ns``)."""

    def __len__(self) -> int:
        return len(self._frames)

    def __iter__(self) -> Iterator[QueuedFrame]:
        return iter(self._frames)

    @property
    def overrun(self) -> bool:
        """Queueing is suspended until the next completion (QUEUE-39)."""
        return self._overrun

    @property
    def last_fence(self) -> Fence | None:
        return self._frames[-1].fence if self._frames else None

    def expected_end_ns(self, now_ns: int) -> int:
        """When the window is expected to be empty: the planning start of a frame
        appended now (QUEUE-38)."""
        if not self._frames:
            return now_ns
        return max(now_ns, self._frames[-1].expected_end_ns)

    def settled_ns(self, now_ns: int) -> int:
        """How far the device's work is settled or planned: the window's expected end
        while frames are queued, else the latest completion (host time since then, the
        planning of the next frame, is no frame's)."""
        if self._frames:
            return self.expected_end_ns(now_ns)
        return min(now_ns, self.last_completed_ns)

    def observe_time(self, now_ns: int) -> None:
        """Mark an overrun when a measured frame runs past its expected end (OPEN-31)."""
        for frame in self._frames:
            if frame.plan.duration_known and now_ns > frame.expected_end_ns:
                self._overrun = True

    def blocking_reason(self, plan: ScheduledPlan) -> str | None:
        """Why ``plan`` cannot be submitted now, or None when it can."""
        if not self._frames:
            return None
        if len(self._frames) >= FRAME_SLOTS:
            return "both frame slots are occupied"
        if plan.requires_empty_window:
            return f"{plan.shape.label()} needs an empty window and completion feedback"
        if self._overrun:
            return "queueing is suspended after an overrun until the next completion"
        tail = self._frames[-1].plan
        if tail.requires_empty_window or not tail.shape.is_generation:
            return f"nothing may queue behind {tail.shape.label()}"
        return None

    def accepts_more(self) -> bool:
        """Whether any plan could be submitted now: the window is empty, or it has a free
        slot behind a queueable tail and no overrun. When False, ``blocking_reason`` is
        not None for every plan, so a planner may skip planning until the next
        completion (a cheap precondition, not another rule)."""
        if not self._frames:
            return True
        if len(self._frames) >= FRAME_SLOTS or self._overrun:
            return False
        tail = self._frames[-1].plan
        return not tail.requires_empty_window and tail.shape.is_generation

    def push(self, frame: QueuedFrame) -> None:
        self._frames.append(frame)

    def pop(self, fence: Fence, now_ns: int | None = None) -> QueuedFrame | None:
        """Remove the oldest frame if it carries ``fence``; completions arrive in order.

        Any completion clears an overrun (QUEUE-39). ``now_ns``: the completion's
        instant. A frame queued behind the completed one could not start before it, so
        its planning interval moves to start no earlier than ``now_ns`` (same expected
        duration; the frames behind it follow). Without this, a frame queued behind a
        late one inherits its lateness and "overruns" its expected end although it ran
        its own estimate (OPEN-31: an overrun is a frame still running past *its*
        expected end), which suspended queueing on every third frame of a steady
        decode stream (docs/benchmarks-speculation.md)."""
        if not self._frames or self._frames[0].fence != fence:
            return None
        self._overrun = False
        done = self._frames.popleft()
        if now_ns is not None:
            self.last_completed_ns = now_ns
            start = now_ns
            for k, frame in enumerate(self._frames):
                if frame.expected_start_ns < start:
                    duration = frame.expected_end_ns - frame.expected_start_ns
                    frame = replace(frame, expected_start_ns=start,
                                    expected_end_ns=start + duration)
                    self._frames[k] = frame
                start = frame.expected_end_ns
        return done

    def frames_for(self, handle: RequestHandle) -> list[QueuedFrame]:
        return [f for f in self._frames if handle in f.plan.handles()]
