"""``SchedulingPolicy``: the interface every policy offers its driver.

The runtime's planner actor and ``flare sim`` drive a policy only through this
structural ``Protocol``: the seed's ``Scheduler`` (with or without speculation) and
each baseline of ``policy/baselines`` implement all of it, so a driver never asks which
policy it holds. Capabilities a policy lacks are harmless no-ops: a policy that does
not schedule by client ignores ``assign_client``, one that learns no acceptance ignores
``observe_counterfactual`` and the round data of ``complete``.

The module also owns the value a completed speculative frame adds to its records
(``RoundCompletion``, one ``RoundLaneOutcome`` per validated lane, and the confidence
sidecar of a device-allocated round; QUEUE-3, QUEUE-4, ACC-28).

Seed sections: *Planning and the execution queue* (plan is pure, commit rechecks,
complete applies the oldest frame), *Service accounting and publication*.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
from policy.vision_windows import ImagePlan

__all__ = [
    "Confidence",
    "Resident",
    "RoundCompletion",
    "RoundLaneOutcome",
    "SchedulingPolicy",
]

Confidence = Sequence[Sequence[Sequence[float]]]
"""The sidecar ``[2, request_slots, draft_capacity]``; plane 1 is the joint prefix
probability (OPEN-16)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundLaneOutcome:
    """One validated lane of a completed speculative round."""

    handle: RequestHandle
    proposed: int
    """Drafts the proposal source supplied."""
    evaluated: int
    """Drafts the target verified (copy proposals may supply fewer than allocated)."""
    accepted: int
    survival: tuple[float, ...] = ()
    """Survival products of the verified prefixes (ACC-28); empty: binary outcomes."""
    beyond: float = -1.0
    """A lane that verified all its drafts: the probability that one more draft would
    have been accepted at the target's last row; negative where not observed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundCompletion:
    """What a completed speculative frame reports beside its records.

    ``confidence`` is read for device-allocated programs only, which cannot complete
    without it (QUEUE-3). A lane absent from ``lanes`` offered no draft (ACC-9)."""

    lanes: tuple[RoundLaneOutcome, ...] = ()
    confidence: Confidence | None = None


class Resident(Protocol):
    """What a driver may read of a resident request (``SchedulingPolicy.request``)."""

    @property
    def handle(self) -> RequestHandle: ...

    @property
    def epoch(self) -> int: ...


@runtime_checkable
class SchedulingPolicy(Protocol):
    """What a policy offers its driver (the planner actor or the simulator)."""

    @property
    def estimates(self) -> DurationEstimates: ...

    @property
    def now_ns(self) -> int: ...

    @property
    def learns_acceptance(self) -> bool:
        """Whether the policy learns acceptance from rounds and counterfactual
        observations (adaptive speculative selection): only then does a driver need to
        collect counterfactual rounds for ``observe_counterfactual``."""
        ...

    def set_catalog(self, shapes: Iterable[GraphShape]) -> None: ...

    def configure_policy(self, config: PolicyConfig) -> None: ...

    def advance_to(self, now_ns: int) -> None: ...

    def admit(self, *, prompt_len: int, max_output_tokens: int, cached_prefix_len: int = 0,
              message_ends: Sequence[int] = (), system_end: int | None = None,
              scored_prompt: bool = False, handle: RequestHandle | None = None,
              grammar_constrained: bool = False, grammar_resident: bool = False,
              images: ImagePlan | None = None, decode_prompt_tail: bool = False,
              arrived_ns: int | None = None) -> RequestHandle:
        """Make a request resident; ``grammar_constrained``: its output follows a
        grammar (QUEUE-13, SEL-13: ``policy.grammar_feedback``); ``grammar_resident``:
        that grammar's matcher is held where the frames run (no feedback needed);
        ``images``: its prompt's image dependencies (``policy.vision_windows``);
        ``decode_prompt_tail``: its one uncached prompt token is its first decode step's
        input, so it starts decoding (``policy.lifecycle.decodes_prompt_tail``);
        ``arrived_ns``: when it reached the server, before any wait for a running slot."""
        ...

    def assign_client(self, handle: RequestHandle, client: str) -> None:
        """Tag a request with its client, right after ``admit`` (client-fair policies
        rank by it; the others ignore it)."""
        ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def request(self, handle: RequestHandle) -> Resident: ...

    def phase(self, handle: RequestHandle) -> Phase: ...

    def plan(self) -> ScheduledPlan | None: ...

    def window_ready(self, plan: ScheduledPlan) -> bool: ...

    def window_open(self) -> bool: ...

    def renew_epoch(self, handle: RequestHandle) -> int:
        """Bind a drained resident request to a fresh generation (PRE-32: a restore
        inside another frame, a window snapshot's); returns its new epoch. Plans made
        before are rebound with ``policy.residency.with_epoch``."""
        ...

    def commit(self, plan: ScheduledPlan, fence: Fence) -> TraceRecord: ...

    def complete(self, fence: Fence, records: Sequence[CompletionRecord],
                 timing: ExecutionTiming, *, round: RoundCompletion | None = None
                 ) -> list[GeneratedToken]:
        """Apply the oldest frame's results; ``round``: what its speculative lanes
        report (None for a frame without one)."""
        ...

    def observe_counterfactual(self, handle: RequestHandle, *, offered: int,
                               accepted: int, terminated: bool,
                               survival: Sequence[float] | None = None) -> None:
        """A round of the policy's proposal source that no frame ran, replayed by the
        host (``Scheduler.observe_counterfactual``)."""
        ...

    def published_output(self, handle: RequestHandle, fence: Fence,
                         host_time_ns: int) -> None: ...

    def nothing_published(self, handle: RequestHandle, fence: Fence) -> None: ...

    def take_released(self) -> list[RequestHandle]: ...

    def statistics(self) -> SchedulerStatistics: ...

    def traces(self) -> tuple[TraceRecord, ...]: ...

    def in_flight(self) -> tuple[Fence, ...]: ...
