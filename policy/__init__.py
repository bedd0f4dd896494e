"""flare's scheduler: pure, synchronous decisions over prepared graphs.

This package never imports trio, torch, or any clock; time enters through
``Scheduler.advance_to(now_ns)``. See ``docs/architecture.md``. The names below are the
package's public surface; modules stay importable for their other helpers.
"""

from policy.descriptors import (
    ExecutionTiming,
    GraphKind,
    GraphShape,
    StateOp,
    TargetBinding,
)
from policy.protocol import RoundCompletion, RoundLaneOutcome, SchedulingPolicy
from policy.round_speculation import SpeculationSettings
from policy.scheduler import Scheduler
from policy.types import (
    AdmissionRefused,
    CommitRejected,
    CompletionError,
    CompletionRecord,
    DecodeMode,
    Fence,
    FinishKind,
    GeneratedToken,
    Lane,
    LaneRole,
    MixedRole,
    Phase,
    PolicyError,
    PublicationError,
    RequestHandle,
    RestoreNeed,
    ScheduledPlan,
    ScheduledStep,
    SchedulerStatistics,
    SelectionReason,
    StaleEpochError,
    StalePlanError,
    TraceRecord,
    UnknownRequestError,
    WindowNotReady,
)

__all__ = [
    "AdmissionRefused",
    "CommitRejected",
    "CompletionError",
    "CompletionRecord",
    "DecodeMode",
    "ExecutionTiming",
    "Fence",
    "FinishKind",
    "GeneratedToken",
    "GraphKind",
    "GraphShape",
    "Lane",
    "LaneRole",
    "MixedRole",
    "Phase",
    "PolicyError",
    "PublicationError",
    "RequestHandle",
    "RestoreNeed",
    "RoundCompletion",
    "RoundLaneOutcome",
    "ScheduledPlan",
    "ScheduledStep",
    "Scheduler",
    "SchedulerStatistics",
    "SchedulingPolicy",
    "SelectionReason",
    "SpeculationSettings",
    "StaleEpochError",
    "StalePlanError",
    "StateOp",
    "TargetBinding",
    "TraceRecord",
    "UnknownRequestError",
    "WindowNotReady",
]
