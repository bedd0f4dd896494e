"""Per-request records the scheduler keeps: phase, cursors, epochs, endpoints, prices.

This module owns ``RequestRecord`` (seed ``scheduler.rs`` request resources): what a
resident request has committed (prompt cursor, output count), what is queued for it
in frames not yet completed, its service history (``policy/service.py``), its output
and terminal age clocks, and the prompt endpoints that restrict prefill work.

Seed sections: *Useful service and selection* (prompt progress counts consumed uncached
prompt tokens; atomic spans, system boundaries and prompt length restrict logical
prefill work), *Prerequisites and completion* (terminal age starts at validated
termination or preemption and is not reset by publication), *Planning and the execution
queue* (a finishing prefill exposes its decoder only after completion).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from policy.descriptors import StateOp
from policy.service import ServiceHistory
from policy.types import Fence, Phase, RequestHandle, RestoreNeed
from policy.vision_windows import ImagePlan, image_chunk_end, images_due


@dataclass(slots=True)
class PendingDelivery:
    """A completed frame's delivery update awaiting its publication report (ACCT-13).

    ``before`` is the delivery rate saved just before the zero-delivery update.
    """

    fence: Fence
    before: float | None
    interval_ms: float


@dataclass(slots=True, kw_only=True)
class RequestRecord:
    """One resident request.

    Cursors are committed state and move only in ``Scheduler.complete``; the
    ``queued_*`` fields count work frozen into frames that have not completed yet and
    are used only for projection and limits (QUEUE-41..48).
    """

    handle: RequestHandle
    epoch: int
    admitted_ns: int
    prompt_len: int
    cached_prefix_len: int
    max_output_tokens: int
    message_ends: tuple[int, ...] = ()
    system_end: int | None = None
    images: ImagePlan | None = None
    """The prompt's image dependencies: prefill chunks stop at their windows and
    never split an image (``policy.vision_windows``, PRE-26..29)."""
    images_encoded: int = 0
    """Images ``0..images_encoded-1`` were encoded by scheduled vision programs
    (``policy.vision_prerequisites``)."""
    scored_prompt: bool = False
    client: str = ""
    """The request's client tag (``assign_client``; empty: untagged). Only flare's
    per-client fairness reads it (``policy/client_shares.py``)."""
    history: ServiceHistory
    phase: Phase = Phase.PREFILL
    prompt_cursor: int = 0
    output_committed: int = 0
    queued_outputs: int = 0
    in_flight_fences: list[Fence] = field(default_factory=list)
    last_visible_ns: int = 0
    """Host time of the last visible output (A_i counts from here, ACCT-18)."""
    queued_delivery_end_ns: int | None = None
    """Expected end of the latest queued frame that delivers to this request (QUEUE-43)."""
    terminal_since_ns: int | None = None
    """When validated termination or preemption began retirement (PRE-41)."""
    last_served_ns: int = 0
    """Last commit that included this request (the DUR-24 recency tie-break)."""
    last_completed_ns: int = 0
    """Host time the latest completed frame with a lane for it completed. flare's stream
    gap limit counts a stream's wait from here when its output is not yet published
    (U-13): publication lag is not a frame holding the stream."""
    arrived_ns: int | None = None
    """When the request reached the server, before any wait for a running slot
    (``Scheduler.admit``); None: at admission. The first-token urgency counts from it."""
    took_last_row: bool = False
    """Its admission held the widest decode program's last row (``policy.decision``
    ``takes_last_row``): while it is resident the spare-row price stays off."""
    cancelled: bool = False
    preempted: bool = False
    failed: bool = False
    pending_delivery: PendingDelivery | None = None
    restore: RestoreNeed = RestoreNeed.NONE
    further_stages: tuple[StateOp, ...] = ()
    """Prerequisite stages still to run after the next one while ``restore`` is not
    NONE (the next is a restore, then these, e.g. an initialization, PRE-21). Each
    prerequisite completion pops the next stage."""
    restored: bool = False
    """The restore stage has run (later stages of the chain remain)."""
    grammar_constrained: bool = False
    """Its output follows a grammar: it never speculates (SEL-13) and, unless the
    grammar is resident where frames run, its plans need completion feedback
    (QUEUE-13; ``policy.grammar_feedback``)."""
    grammar_resident: bool = False
    """Its grammar's matcher lives with the programs (the executing process advances
    it with each sampled token and computes the next mask), so its next frame needs no
    host feedback (``policy.grammar_feedback``, docs/runtime.md)."""
    ends_at: tuple[int, int, int] = field(default=(-1, 0, 0), repr=False, compare=False)
    """``(cursor, logical end, next endpoint)`` as last computed by ``prompt_ends``."""

    @property
    def next_stage(self) -> StateOp:
        """The prerequisite op that must run next (meaningful while ``restore`` is not
        NONE)."""
        if not self.restored:
            return StateOp.RESTORE
        return self.further_stages[0]

    @property
    def remaining_stages(self) -> tuple[StateOp, ...]:
        """Every prerequisite stage still to run, the next first."""
        if self.restore is RestoreNeed.NONE:
            return ()
        if not self.restored:
            return (StateOp.RESTORE, *self.further_stages)
        return self.further_stages

    def vision_due(self) -> range:
        """The images a vision prerequisite must encode before the next prompt chunk
        (empty without images or once the active window is encoded)."""
        if self.images is None:
            return range(0)
        return images_due(self.images, self.prompt_cursor, self.images_encoded)

    # ---- prompt work -------------------------------------------------------------

    @property
    def uncached_remaining(self) -> int:
        return max(self.prompt_len - self.prompt_cursor, 0)

    def logical_prompt_end(self) -> int:
        """Where the next prefill chunk must stop: the system boundary if the cursor
        is before it, else the prompt end (SEL-40, OPEN-36), and earlier where an
        image window or span says so (PRE-28, PRE-29)."""
        end = self.prompt_len
        if self.system_end is not None and self.prompt_cursor < self.system_end:
            end = min(self.system_end, self.prompt_len)
        if self.images is not None:
            end = image_chunk_end(self.images, self.prompt_cursor, end)
        return end

    def prompt_ends(self) -> tuple[int, int]:
        """``(logical_prompt_end(), next_endpoint())``, recomputed only when the cursor
        moved (the prompt's boundaries are fixed at admission)."""
        cursor, end, endpoint = self.ends_at
        if cursor != self.prompt_cursor:
            end, endpoint = self.logical_prompt_end(), self.next_endpoint()
            self.ends_at = (self.prompt_cursor, end, endpoint)
        return end, endpoint

    def next_endpoint(self) -> int:
        """The next message or prompt endpoint after the cursor (DUR-20's limit)."""
        limit = self.logical_prompt_end()
        i = bisect.bisect_right(self.message_ends, self.prompt_cursor)
        if i < len(self.message_ends):
            return min(self.message_ends[i], limit)
        return limit

    # ---- output work -------------------------------------------------------------

    @property
    def output_room(self) -> int:
        """Output tokens still allowed after committed and queued work (QUEUE-48)."""
        return self.max_output_tokens - self.output_committed - self.queued_outputs

    @property
    def in_flight(self) -> bool:
        return bool(self.in_flight_fences)

    @property
    def selectable(self) -> bool:
        """Whether any candidate may include this request now (QUEUE-8, QUEUE-15)."""
        if self.cancelled or self.phase is Phase.RETIRED:
            return False
        if self.restore is not RestoreNeed.NONE:
            return False  # only a restore prerequisite can serve it (prerequisites.py)
        if self.phase is Phase.DECODE:
            return self.output_room > 0
        # Prefill and terminal work drain the window, so a request with a frame in
        # flight has nothing selectable until that frame completes.
        return not self.in_flight

    @property
    def restorable(self) -> bool:
        """Ready for a restore graph now (PRE-1)."""
        return (self.restore is RestoreNeed.READY and not self.cancelled
                and self.phase is not Phase.RETIRED and not self.in_flight)

    def output_since_ns(self) -> int:
        """Where the projected output age A_i starts (QUEUE-43): a queued expected
        delivery when there is one, else the last visible output."""
        since = self.last_visible_ns
        if self.queued_delivery_end_ns is not None:
            since = max(since, self.queued_delivery_end_ns)
        return since

    def output_age_ns(self, at_ns: int) -> int:
        """Projected output age A_i at ``at_ns``."""
        return max(at_ns - self.output_since_ns(), 0)

    def held_since_ns(self) -> int:
        """Where flare's stream gap wait starts (U-13): the output age's start, or the
        latest completed frame that carried this request when that is later (an output
        still being published holds the stream in no frame)."""
        return max(self.output_since_ns(), self.last_completed_ns)

    def terminal_age_ns(self, at_ns: int) -> int:
        if self.terminal_since_ns is None:
            return 0
        return max(at_ns - self.terminal_since_ns, 0)
