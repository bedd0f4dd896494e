"""flare's scheduler: pure, synchronous decisions over prepared graphs.

This package never imports trio, torch, or any clock; time enters through
``Scheduler.advance_to(now_ns)``. See ``docs/architecture.md``. The names below are the
package's public surface; modules stay importable for their other helpers.
"""

from policy.admission_order import (
    ADMISSION_ORDERS,
    check_admission_order,
    least_slack_key,
    pure_prefill_ns,
)
from policy.baselines.factory import (
    FIXED_SPEC_POLICIES,
    PRESET_POLICIES,
    RUNTIME_POLICIES,
    SEED_POLICIES,
    make_policy,
)
from policy.config import PolicyConfig, policy_preset
from policy.descriptors import (
    ExecutionTiming,
    GraphKind,
    GraphShape,
    StateOp,
    TargetBinding,
)
from policy.frame_queue import FRAME_SLOTS
from policy.lifecycle import context_limit, context_room, decodes_prompt_tail, fits_context
from policy.protocol import RoundCompletion, RoundLaneOutcome, SchedulingPolicy
from policy.residency import with_epoch
from policy.round_speculation import SpeculationSettings
from policy.rounds import SpeculationMode
from policy.scheduler import Scheduler
from policy.speculation import ProposalSource
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
from policy.vision_windows import (
    DEFAULT_WINDOW_IMAGES,
    ImagePlan,
    smallest_prompt_capacity,
    vision_lane_images,
    window_spans,
)

__all__ = [
    "ADMISSION_ORDERS",
    "DEFAULT_WINDOW_IMAGES",
    "FIXED_SPEC_POLICIES",
    "FRAME_SLOTS",
    "PRESET_POLICIES",
    "RUNTIME_POLICIES",
    "SEED_POLICIES",
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
    "ImagePlan",
    "Lane",
    "LaneRole",
    "MixedRole",
    "Phase",
    "PolicyConfig",
    "PolicyError",
    "ProposalSource",
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
    "SpeculationMode",
    "SpeculationSettings",
    "StaleEpochError",
    "StalePlanError",
    "StateOp",
    "TargetBinding",
    "TraceRecord",
    "UnknownRequestError",
    "WindowNotReady",
    "check_admission_order",
    "context_limit",
    "context_room",
    "decodes_prompt_tail",
    "fits_context",
    "least_slack_key",
    "make_policy",
    "policy_preset",
    "pure_prefill_ns",
    "smallest_prompt_capacity",
    "vision_lane_images",
    "window_spans",
    "with_epoch",
]
