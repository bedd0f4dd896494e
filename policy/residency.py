"""Resident requests and execution counters, shared by every policy.

``Residency`` holds the resident request records by handle: handle and epoch
assignment at admission (a reused handle gets a larger epoch, so its old fences can
never charge it, ACCT-5), lookup, cancellation (QUEUE-8) and release of retired
requests with no fence outstanding (PRE-39, PRE-54, QUEUE-9). ``EpochRenewal`` gives a
policy ``renew_epoch``: a resident request bound to a fresh generation outside a restore
lane (PRE-32), and ``with_epoch`` rebinds a plan's lanes to it. ``ExecutionCounters``
holds what ``statistics()`` and ``traces()`` report: executions and their time by
selection reason, committed plans, failed lanes and the recent committed-plan traces.
The seed's ``Scheduler`` and the baselines keep their own record types
(``RequestRecord`` and its subclass ``BaselineRequest``) in them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from policy.requests import RequestRecord
from policy.types import (
    AdmissionRefused,
    Fence,
    Phase,
    PolicyError,
    RequestHandle,
    ScheduledPlan,
    SchedulerStatistics,
    SelectionReason,
    TraceRecord,
    UnknownRequestError,
)

__all__ = ["TRACE_HISTORY", "EpochRenewal", "ExecutionCounters", "Residency", "with_epoch"]

TRACE_HISTORY = 1024
"""Committed-plan traces kept for ``traces()``; older ones are dropped."""

R = TypeVar("R", bound=RequestRecord)


class Residency(Generic[R]):
    """The resident request records by handle, and the epochs handles have used."""

    def __init__(self) -> None:
        self.records: dict[RequestHandle, R] = {}
        """The live records (read-only use outside the owning policy)."""
        self.last_epoch: dict[RequestHandle, int] = {}
        """The latest epoch each handle ever had, resident or not."""
        self._next_handle = 1

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, handle: object) -> bool:
        return handle in self.records

    def __iter__(self) -> Iterator[RequestHandle]:
        return iter(self.records)

    def claim(self, handle: RequestHandle | None) -> tuple[RequestHandle, int]:
        """A handle (``handle``, or the next unused one) and its new epoch for a request
        being admitted; refused when that handle is resident. The caller stores the
        record with ``add``."""
        if handle is None:
            handle = RequestHandle(self._next_handle)
        if handle in self.records:
            raise AdmissionRefused(f"handle {handle} is already resident")
        self._next_handle = max(self._next_handle, handle + 1)
        epoch = self.last_epoch.get(handle, -1) + 1
        self.last_epoch[handle] = epoch
        return handle, epoch

    def add(self, record: R) -> None:
        self.records[record.handle] = record

    def renew_epoch(self, record: R) -> None:
        """``record`` moved to a fresh epoch (a restore binds a new generation, PRE-32)."""
        record.epoch += 1
        self.last_epoch[record.handle] = record.epoch

    def get(self, handle: RequestHandle) -> R:
        rec = self.records.get(handle)
        if rec is None:
            raise UnknownRequestError(f"request {handle} is not resident")
        return rec

    def cancel(self, handle: RequestHandle) -> None:
        """Stop selecting ``handle`` at once (QUEUE-8); released after its last fence."""
        rec = self.get(handle)
        rec.cancelled = True
        rec.phase = Phase.RETIRED

    def release(self) -> list[RequestHandle]:
        """Handles retired, cancelled or failed with no submitted fence outstanding; they
        stop being resident."""
        done = [h for h, r in self.records.items()
                if r.phase is Phase.RETIRED and not r.in_flight]
        for h in done:
            del self.records[h]
        return done


class EpochRenewal:
    """``renew_epoch`` for a policy that keeps its records in ``self._residency`` (the
    seed's ``Scheduler`` and the baselines)."""

    _residency: Residency[Any]

    def renew_epoch(self, handle: RequestHandle) -> int:
        """Bind resident ``handle`` to a fresh generation now and return its new epoch
        (PRE-32): a restore the driver runs inside another frame (a window snapshot's,
        docs/vision.md). A plan made before no longer commits (``with_epoch`` rebinds
        it), and every lane or completion of the old epoch is rejected. Refused while a
        frame of the request is in flight: that frame's completion would be stale."""
        rec: RequestRecord = self._residency.get(handle)
        if rec.in_flight:
            raise PolicyError(f"request {handle} has a frame in flight; drain it first")
        self._residency.renew_epoch(rec)
        return rec.epoch


def with_epoch(plan: ScheduledPlan, handle: RequestHandle, epoch: int) -> ScheduledPlan:
    """``plan`` with ``handle``'s lanes carrying ``epoch`` (after ``renew_epoch``)."""
    lanes = tuple(lane._replace(epoch=epoch) if lane.handle == handle else lane
                  for lane in plan.lanes)
    return replace(plan, step=replace(plan.step, lanes=lanes))


def _by_reason() -> dict[str, int]:
    return {r.value: 0 for r in SelectionReason}


@dataclass(slots=True)
class ExecutionCounters:
    """Executions by selection reason, committed plans, failed lanes, recent traces."""

    executions: dict[str, int] = field(default_factory=_by_reason)
    execution_ns: dict[str, int] = field(default_factory=_by_reason)
    committed: int = 0
    failed_lanes: int = 0
    traces: deque[TraceRecord] = field(default_factory=lambda: deque(maxlen=TRACE_HISTORY))

    def executed(self, reason: SelectionReason, duration_ns: int) -> None:
        self.executions[reason.value] += 1
        self.execution_ns[reason.value] += duration_ns

    def trace(self, plan: ScheduledPlan, fence: Fence, *, observation_age_ns: int | None,
              exploration_credit_ns: float, log_scale: float, now_ns: int) -> TraceRecord:
        """The trace of ``plan`` committed as ``fence`` at ``now_ns``, kept for
        ``traces()``."""
        trace = TraceRecord(
            fence=fence, shape=plan.shape, lanes=len(plan.lanes),
            selected_cost_ns=plan.estimated_duration_ns,
            observation_age_ns=observation_age_ns, reason=plan.reason,
            exploration_credit_ns=exploration_credit_ns,
            value_rate=plan.selection_value_rate(), log_scale=log_scale,
            committed_at_ns=now_ns,
        )
        self.traces.append(trace)
        return trace

    def statistics(self, *, resident: int, in_flight: int, refresh_credit_ns: float
                   ) -> SchedulerStatistics:
        return SchedulerStatistics(
            executions=dict(self.executions), execution_ns=dict(self.execution_ns),
            resident=resident, in_flight=in_flight, refresh_credit_ns=refresh_credit_ns,
            committed_plans=self.committed, failed_lanes=self.failed_lanes,
        )
