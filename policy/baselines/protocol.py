"""The planner interface every policy offers: the seed's ``Scheduler`` and each baseline.

This module owns ``Planner``, a structural ``Protocol`` naming the methods (and value
types) the runtime's planner and ``flare sim`` drive. ``policy.Scheduler`` satisfies it
unchanged; the baselines in this package implement it from scratch over the same
prepared shapes. Client tags are not part of it (``Scheduler.admit`` takes none):
baselines that need one offer ``assign_client`` (see ``ClientTagged``).

Seed sections: *Planning and the execution queue* (plan is pure, commit rechecks,
complete applies the oldest frame), *Service accounting and publication*.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from policy.config import PolicyConfig
from policy.descriptors import ExecutionTiming, GraphShape
from policy.duration_estimates import DurationEstimates
from policy.types import (
    CompletionRecord,
    Fence,
    GeneratedToken,
    Phase,
    RequestHandle,
    ScheduledPlan,
    SchedulerStatistics,
    TraceRecord,
)


class Resident(Protocol):
    """What a driver may read of a resident request (``Planner.request``)."""

    @property
    def handle(self) -> RequestHandle: ...

    @property
    def epoch(self) -> int: ...


@runtime_checkable
class Planner(Protocol):
    """What a policy offers its driver (the planner actor or the simulator)."""

    @property
    def estimates(self) -> DurationEstimates: ...

    @property
    def now_ns(self) -> int: ...

    def set_catalog(self, shapes: Iterable[GraphShape]) -> None: ...

    def configure_policy(self, config: PolicyConfig) -> None: ...

    def advance_to(self, now_ns: int) -> None: ...

    def admit(self, *, prompt_len: int, max_output_tokens: int, cached_prefix_len: int = 0,
              message_ends: Sequence[int] = (), system_end: int | None = None,
              scored_prompt: bool = False, handle: RequestHandle | None = None
              ) -> RequestHandle: ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def request(self, handle: RequestHandle) -> Resident: ...

    def phase(self, handle: RequestHandle) -> Phase: ...

    def plan(self) -> ScheduledPlan | None: ...

    def window_ready(self, plan: ScheduledPlan) -> bool: ...

    def window_open(self) -> bool: ...

    def commit(self, plan: ScheduledPlan, fence: Fence) -> TraceRecord: ...

    def complete(self, fence: Fence, records: Sequence[CompletionRecord],
                 timing: ExecutionTiming) -> list[GeneratedToken]: ...

    def published_output(self, handle: RequestHandle, fence: Fence,
                         host_time_ns: int) -> None: ...

    def nothing_published(self, handle: RequestHandle, fence: Fence) -> None: ...

    def take_released(self) -> list[RequestHandle]: ...

    def statistics(self) -> SchedulerStatistics: ...

    def traces(self) -> tuple[TraceRecord, ...]: ...

    def in_flight(self) -> tuple[Fence, ...]: ...


@runtime_checkable
class ClientTagged(Protocol):
    """A policy that schedules by client: tag a request right after ``admit``."""

    def assign_client(self, handle: RequestHandle, client: str) -> None: ...
