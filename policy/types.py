"""Values exchanged between the scheduler and the runtime around it.

This module owns the scheduler's vocabulary: request and fence ids, the frozen plan
(``ScheduledPlan`` with its one ``ScheduledStep``), what a completion reports
(``CompletionRecord``), what the scheduler hands back (``GeneratedToken``), the trace
record of every committed plan, the counters snapshot, and the policy error family.
Everything here is an immutable value; behaviour lives in ``policy/scheduler.py``.

Seed sections: *Planning and the execution queue* (a plan freezes physical shape,
logical lane work, request epochs, estimated duration and selection score),
*Useful service and selection* (``selection_value_rate()`` and
``selection_log_scale()``), *Mixed execution contract* (``ScheduledStep.mixed``),
*Completed confidence and acceptance* (the trace record's fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, NewType

from policy.descriptors import GraphShape, IdentityEnum

RequestHandle = NewType("RequestHandle", int)
"""A resident request's id. A reused handle always comes back with a larger epoch."""

Fence = NewType("Fence", int)
"""The runtime's id for one committed frame; strictly increasing per scheduler."""


class Phase(IdentityEnum):
    """Where a resident request is in its life (seed: phase transitions)."""

    PREFILL = "prefill"
    """Uncached prompt tokens remain to be consumed."""
    DECODE = "decode"
    """The prompt is consumed; the request produces output tokens."""
    TERMINAL = "terminal"
    """Termination was validated (or preemption began); a terminal snapshot is pending."""
    RETIRED = "retired"
    """Nothing more will be planned; resources free once its last fence retires."""


class LaneRole(IdentityEnum):
    """What one lane of a step does for its request."""

    PROMPT = "prompt"
    DECODE = "decode"
    TERMINAL = "terminal"
    RESTORE = "restore"
    """A state-operation row that restores the request's saved state (a prerequisite)."""
    INITIALIZE = "initialize"
    """A state-operation row that initializes the request's state (a prerequisite stage
    after a restore, PRE-1, PRE-21)."""
    VISION = "vision"
    """Encodes images of the request's active window into feature storage (a
    prerequisite of its next prompt chunk, ``policy.vision_prerequisites``)."""


class RestoreNeed(IdentityEnum):
    """Whether a resident request must have its state restored before more work."""

    NONE = "none"
    AWAITING = "awaiting"
    """Waiting for external restoration (host or disk copy); outside every participant
    set and never selectable (ACCT-4)."""
    READY = "ready"
    """Its state can be restored by a prepared restore graph (PRE-1)."""


class SelectionReason(IdentityEnum):
    """Why a plan was chosen; also the execution-counter kind (ACCT, LRN-20)."""

    ORDINARY = "ordinary"
    DISCOVERY = "discovery"
    TIMING_REFRESH = "timing_refresh"
    ACCEPTANCE_LEARNING = "acceptance_learning"


class DecodeMode(IdentityEnum):
    """The decode mode a mixed step runs its decoder rows in (MIX-7, MIX-10).

    Ordinary selection plans ``ORDINARY``; speculative mixed programs run their decode
    rows ``SPECULATIVE`` (``policy/mixed_rounds.py``).
    """

    ORDINARY = "ordinary"
    SPECULATIVE = "speculative"


class Lane(NamedTuple):
    """One request's logical work in a step (immutable).

    ``prompt_start``/``prompt_tokens``: the prompt extent a PROMPT lane consumes.
    ``token_ceiling``: the most output tokens the lane may commit (1 for ordinary
    decode and for a prompt lane that reaches the prompt end, else 0; a speculative
    lane's ``min(D + 1, W, request limit)`` later).
    ``expected_tokens``/``expected_deliveries``: what selection expected (frozen).
    ``value``: the lane's scaled contribution to the plan's value (diagnostic).

    A NamedTuple rather than a frozen dataclass because ``plan()`` builds up to 64 of
    them per decision and tuple construction is several times cheaper; build it with
    keywords and read it by attribute.
    """

    handle: RequestHandle
    epoch: int
    role: LaneRole
    prompt_start: int = 0
    prompt_tokens: int = 0
    token_ceiling: int = 0
    expected_tokens: float = 0.0
    expected_deliveries: float = 0.0
    value: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MixedRole:
    """``ScheduledStep.mixed``: the prompt row's index in the dense lane list
    (``-1`` for none, the int32 ``prefill_row`` input) and the decode mode (MIX-7)."""

    prefill_row: int
    decode_mode: DecodeMode = DecodeMode.ORDINARY


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledStep:
    """One physical program execution: its shape and dense lane list.

    ``mixed`` is set exactly when ``shape.kind`` is MIXED.
    """

    shape: GraphShape
    lanes: tuple[Lane, ...]
    mixed: MixedRole | None = None

    @property
    def padding_rows(self) -> int:
        """Physical request rows left unused (padding earns nothing, MIX-21)."""
        return max(self.shape.batch_capacity - len(self.lanes), 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledPlan:
    """A frozen selection: what to run, for whom, and why (QUEUE-5).

    ``estimated_duration_ns`` is the first step's own estimate (0 = unknown); any
    lookahead time is never part of it (PRE-17). ``scaled_score`` and ``log_scale``
    reproduce the unscaled value rate as ``scaled_score * exp(log_scale)``; the scale
    is a power of two, so ``math.ldexp(scaled_score, scale_exponent)`` is exact.
    For an unknown-duration winner ``scaled_score`` is its optimistic work score:
    the scaled useful value per millisecond, as if it took one millisecond (OPEN-13).

    ``requires_empty_window``: commit only when no frame is in flight (QUEUE-12,
    DUR-25, DUR-27). ``planned_at_ns``: the scheduler clock when planned;
    ``start_ns``: the projected start (the queue's expected end, QUEUE-38).
    """

    step: ScheduledStep
    estimated_duration_ns: int
    scaled_score: float
    scale_exponent: int
    duration_known: bool
    stale: bool
    reason: SelectionReason
    requires_empty_window: bool
    planned_at_ns: int
    start_ns: int
    useful_value: float
    """Scaled useful value of the step (the unknown-duration ranking key, DUR-23)."""
    lookahead_shape: GraphShape | None = None
    """The following inference shape a prerequisite was scored with (PRE-2)."""

    def selection_value_rate(self) -> float:
        """The scaled score of this plan (SEL-21)."""
        return self.scaled_score

    def selection_log_scale(self) -> float:
        """The natural logarithm of the decision's shared scaling factor (SEL-22)."""
        return self.scale_exponent * math.log(2.0)

    @property
    def shape(self) -> GraphShape:
        return self.step.shape

    @property
    def lanes(self) -> tuple[Lane, ...]:
        return self.step.lanes

    def handles(self) -> tuple[RequestHandle, ...]:
        return tuple(lane.handle for lane in self.step.lanes)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRecord:
    """What the completion validator reports for one lane of a finished frame.

    ``token_ids``: committed output tokens for this lane (empty for a prompt chunk
    that does not reach the prompt end and for terminal snapshots).
    ``prompt_tokens``: prompt tokens the lane consumed (must equal the plan's extent).
    ``terminated``: the validator saw EOS or a stop token in ``token_ids``.
    ``ok``: False when the validator found the lane malformed; only that lane fails.
    """

    handle: RequestHandle
    epoch: int
    token_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0
    terminated: bool = False
    ok: bool = True


class FinishKind(IdentityEnum):
    """Why a request's output ended (carried on its last ``GeneratedToken``)."""

    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratedToken:
    """Committed output for one request from one frame, returned by ``complete``.

    ``token_ids`` may be empty when ``finish`` is ERROR. ``first`` marks the
    request's first output (the end of its prompt).
    """

    handle: RequestHandle
    epoch: int
    fence: Fence
    token_ids: tuple[int, ...]
    first: bool = False
    finish: FinishKind | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRecord:
    """One committed plan (seed: a trace attaches physical shape, selected cost,
    observation age, selection reason and exploration credit to each plan).

    ``observation_age_ns`` is ``None`` for an unmeasured shape.
    ``exploration_credit_ns`` is the timing-refresh balance at commit.
    """

    fence: Fence
    shape: GraphShape
    lanes: int
    selected_cost_ns: int
    observation_age_ns: int | None
    reason: SelectionReason
    exploration_credit_ns: float
    value_rate: float
    log_scale: float
    committed_at_ns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStatistics:
    """A frozen snapshot of the scheduler's counters (house style ``statistics()``).

    ``executions`` and ``execution_ns`` are keyed by ``SelectionReason.value``
    (``flare_scheduler_executions_total{kind}`` and
    ``flare_scheduler_execution_nanoseconds_total{kind}``).
    """

    executions: dict[str, int]
    execution_ns: dict[str, int]
    resident: int
    in_flight: int
    refresh_credit_ns: float
    committed_plans: int
    failed_lanes: int


class PolicyError(Exception):
    """Base of every error the scheduler raises."""


class UnknownRequestError(PolicyError):
    """Raised when a handle is not resident (never admitted, or already removed)."""


class AdmissionRefused(PolicyError):
    """Raised by ``admit`` when the request cannot be made resident as described."""


class CommitRejected(PolicyError):
    """Raised by ``commit`` when a plan fails its checks; drop the plan and replan."""


class StaleEpochError(CommitRejected):
    """A lane's request was cancelled, retired, restored or re-admitted since planning."""


class StalePlanError(CommitRejected):
    """The plan no longer matches the request state it was made from, or its graph
    estimate went stale/unknown while the window is not empty (DUR-28, OPEN-12)."""


class WindowNotReady(CommitRejected):
    """Both frame slots are taken, queueing is suspended after an overrun, or the plan
    needs an empty window and frames are still in flight (QUEUE-10..14, QUEUE-39)."""


class CompletionError(PolicyError):
    """Raised by ``complete`` when the fence is unknown or out of order; nothing is
    updated. Malformed lanes do not raise: they fail only their own requests."""


class PublicationError(PolicyError):
    """Raised by ``published_output`` for a fence that never served the request."""
