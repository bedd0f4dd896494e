"""Every message the runtime's actors exchange, and one inbox union per actor.

Messages are values (house style 3): frozen, slotted, keyword-only dataclasses with
tuples and ``NewType`` ids, and no behaviour. The only non-value fields are channel
ends whose ownership moves with the message (a client's event channel travels from
admission to the planner to the publisher, which closes it) and one-shot reply ends
(size one, written exactly once, so the replier never blocks).

Data flow (architecture: *Data flow of one request*, steps 1-7)::

    client --Admit/Withdraw--> admission --Acquire--> checkpoint-allocator
    admission --Admitted/Cancel--> planner --Reserve/Release--> checkpoint-allocator
    planner --FrameOrder--> frame-dispatcher --FrameOutcome--> completion-validator
    completion-validator --ValidatedFrame--> planner, --FenceRetired--> checkpoint-allocator
    planner --Track/EpochRenewed/PublishFrame/Drop--> publisher --Published--> planner
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

import trio

from actors.errors import AdmissionError
from actors.public import FinishReason, GenerationRequest, StreamEvent
from gpu import Alternatives, Completion, Frame, ProgramFault
from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GeneratedToken,
    RequestHandle,
    ScheduledPlan,
)

if TYPE_CHECKING:
    from actors.grammar import RequestGrammar
    from gpu import SpeculativeFrame, SpeculativeMixedFrame

__all__ = [
    "Fence",
    "PageId",
    "RequestHandle",
    "RequestId",
    "StateRow",
]

RequestId = NewType("RequestId", int)
"""The runtime's id for one ``generate`` call, from submission to its last event."""

StateRow = NewType("StateRow", int)
"""An index into the device request state (``gpu.request_state``)."""

PageId = NewType("PageId", int)
"""An index into the paged KV cache."""

EventSender = trio.MemorySendChannel[StreamEvent]


# ------------------------------------------------------------------- client -> admission


@dataclass(frozen=True, slots=True, kw_only=True)
class Admit:
    """A new generation (step 1). ``events`` is the client's private stream; its
    ownership passes to the runtime. ``decision`` receives ``None`` (accepted, the
    request is queued) or the ``AdmissionError`` that refuses it."""

    request_id: RequestId
    request: GenerationRequest
    events: EventSender
    decision: trio.MemorySendChannel[AdmissionError | None]
    arrived_ns: int | None = None
    """Runtime clock when the caller submitted it (the start of its queue time)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Withdraw:
    """The client left (or cancelled): stop the request wherever it is."""

    request_id: RequestId


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantArrived:
    """Admission's own note that the allocator answered the queue head's ``Acquire``."""

    request_id: RequestId
    grant: Grant | None


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseAdmission:
    """Shutdown, phase one: refuse new requests and end the queued ones."""


AdmissionInbox = Admit | Withdraw | GrantArrived | CloseAdmission


# ------------------------------------------------------------------- checkpoint-allocator


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """Resources for one admitted request: its state row (which is also its scheduler
    handle), the row's generation in the allocator's bookkeeping (lanes carry the
    scheduler's own epoch for the handle), and the prefix-cache hit (full pages shared
    by reference)."""

    handle: RequestHandle
    epoch: int
    row: StateRow
    cached_pages: tuple[PageId, ...]
    cached_tokens: int
    snapshot_row: StateRow | None = None
    """The request's private window snapshot row, when its images span several
    windows (PRE-30, ``actors.window_snapshots``)."""
    page_copy: tuple[PageId, PageId] | None = None
    """(cached page, its own last page of ``cached_pages``): the first frame copies the
    one into the other (``Acquire.copy_last_page``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Acquire:
    """Admission asks for a state row, the request's worst-case page budget and its
    cached prefix. Answered once on ``reply``: a ``Grant`` now or when resources
    free, or ``None`` if withdrawn first."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    message_ends: tuple[int, ...]
    use_prefix_cache: bool
    reply: trio.MemorySendChannel[Grant | None]
    prompt_group: str = ""
    """Requests of one group with one prompt share its prefill (``ResourceBook``)."""
    window_snapshots: bool = False
    """Its images span several windows: it needs a private snapshot row (PRE-30)."""
    copy_last_page: bool = False
    """A prompt found whole leaves one token uncached (``ResourceBook.acquire``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelAcquire:
    """Admission withdraws a parked ``Acquire`` (the client left while queued)."""

    request_id: RequestId


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneExtent:
    """A lane's KV extent after the frame: the request must own pages covering
    ``kv_tokens`` positions."""

    handle: RequestHandle
    kv_tokens: int
    snapshot: bool = False
    """A terminal snapshot lane (PRE-38, PRE-39): the request keeps its pages and
    needs a snapshot destination for the partial page at ``kv_tokens``; the reply
    carries a ``SnapshotPlan`` for it."""
    window_snapshot_at: int | None = None
    """A prompt lane that starts a new image window: the request is snapshotted into
    its private row at this consumed extent and restored first (PRE-31); the reply
    carries that ``SnapshotPlan`` before the lane's pages."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotPlan:
    """What a snapshot copies: the request's state at ``kv_tokens`` (``page_ids``
    cover the written positions) into ``scratch_row``, and the partial last page into
    ``dst_page`` (-1: ``kv_tokens`` ends on a page boundary, or no destination). A
    terminal lane re-initialises its row from the host's view first; a window
    snapshot's ``scratch_row`` is the request's private snapshot row (PRE-30)."""

    handle: RequestHandle
    row: StateRow
    scratch_row: StateRow
    kv_tokens: int
    page_ids: tuple[PageId, ...]
    dst_page: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PagePlan:
    """New pages for one request: block ``first_block`` onwards gets ``page_ids``."""

    handle: RequestHandle
    row: StateRow
    first_block: int
    page_ids: tuple[PageId, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Reserve:
    """The planner reserves pages before ``commit`` (step 3) and pins them to ``fence``.
    The reply lists newly taken pages (empty if the request already owns enough)."""

    fence: Fence
    extents: tuple[LaneExtent, ...]
    reply: trio.MemorySendChannel[tuple[PagePlan | SnapshotPlan, ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """The request is done (finished, cancelled, failed). Its row and pages return
    once the last fence it was reserved for retires (QUEUE-9, PRE-54). ``token_ids`` is the content of its
    first ``kv_tokens`` positions; with ``publish`` its full pages enter the prefix
    cache (the terminal snapshot of a normal completion, OPEN-35)."""

    handle: RequestHandle
    token_ids: tuple[int, ...] = ()
    kv_tokens: int = 0
    publish: bool = False
    snapshot_done: bool = False
    """Its terminal snapshot frame completed: the copied partial page (the snapshot
    destination) replaces the request's own partial page in the published chain."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Finishing:
    """The request's output ended normally while its terminal capture is still to run;
    its client's ``Finished`` follows at once. Until the request's release is final,
    the allocator holds back the next turn of its conversation (PRE-53, OPEN-35).
    ``token_ids`` is the content of its first ``kv_tokens`` positions."""

    handle: RequestHandle
    token_ids: tuple[int, ...]
    kv_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FenceRetired:
    """The frame ``fence`` finished on the device (successfully or not): nothing it
    used is in use any more (step 7). ``failed``: requests whose lane the validator
    rejected (every lane of a faulted frame): what it wrote for them is not shared."""

    fence: Fence
    failed: tuple[RequestHandle, ...] = ()


AllocatorInbox = Acquire | CancelAcquire | Reserve | Release | Finishing | FenceRetired


# ------------------------------------------------------------------- planner


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """A request made resident by admission (step 2)."""

    request_id: RequestId
    request: GenerationRequest
    grant: Grant
    events: EventSender
    arrived_ns: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """Stop a request at once (QUEUE-8); ignored if it is no longer resident."""

    request_id: RequestId


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionClosed:
    """Admission admits nothing more: the planner drains and then stops."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneFailure:
    """A lane the validator rejected, with the reason the client will see."""

    handle: RequestHandle
    epoch: int
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidatedFrame:
    """A completed frame after validation (step 5): one record per planned lane, in
    lane order; ``failures`` explains every record with ``ok=False``."""

    fence: Fence
    plan: ScheduledPlan
    records: tuple[CompletionRecord, ...]
    failures: tuple[LaneFailure, ...]
    timing: ExecutionTiming
    logprobs: tuple[tuple[float, ...], ...]
    prompt_logprobs: tuple[float, ...] | None
    top_logprobs: tuple[tuple[Alternatives, ...], ...] = ()
    """Per lane, per token of ``logprobs``: the top alternatives (``TOP_LOGPROBS``)."""
    prompt_top_logprobs: tuple[Alternatives, ...] | None = None
    """Scored prefill: per chunk token, the alternatives for the next prompt token."""
    fault: str | None = None
    """The program fault that failed the whole frame, if any."""
    launched_ns: int = 0
    observed_ns: int = 0
    """Runtime clock at launch and when the completion was observed."""
    rounds: SpeculativeRounds | None = None
    """A speculative frame's validated sidecars (None for every other frame)."""
    draft_proposals: tuple[tuple[RequestHandle, int], ...] = ()
    """Lanes whose width-one step kept the learned draft's context, with the draft's
    greedy proposal for the token the lane emitted (``gpu.frames.LaneSample``)."""
    draft_acceptances: tuple[tuple[RequestHandle, float], ...] = ()
    """Sampled lanes of such steps, with a depth-one draft's acceptance probability
    ``sum min(p, q)`` for the token the lane emitted (``gpu.frames.LaneSample``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundLane:
    """One validated speculative lane: drafts the source supplied, drafts the target
    verified and accepted, and the survival products of its verified prefixes."""

    handle: RequestHandle
    proposed: int
    evaluated: int
    accepted: int
    survival: tuple[float, ...]
    beyond: float = -1.0
    """A learned round's lane that verified all its drafts: the probability that one
    more draft would have been accepted at the target's last row, along the drafted
    prefix (``SpeculativeLane.beyond``); -1 otherwise."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeRounds:
    """What a speculative frame adds for completion (QUEUE-3, QUEUE-4): the confidence
    sidecar ``[2, B, D]`` as nested tuples and one entry per valid lane."""

    confidence: tuple[tuple[tuple[float, ...], ...], ...]
    lanes: tuple[RoundLane, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFinish:
    """The publisher ended a request's output (stop string, EOS, length)."""

    handle: RequestHandle
    epoch: int
    reason: FinishReason


@dataclass(frozen=True, slots=True, kw_only=True)
class Published:
    """The publisher processed ``fence`` (step 6). ``visible`` lists the handles whose
    output became visible, with the host time; a fence with nothing visible is still
    reported (OPEN-20), so the planner can order completions after it (ACCT-17)."""

    fence: Fence
    visible: tuple[tuple[RequestHandle, int], ...]
    finished: tuple[HostFinish, ...]


PlannerInbox = Admitted | Cancel | AdmissionClosed | ValidatedFrame | Published


# ------------------------------------------------------------------- dispatcher/validator


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneContext:
    """What the validator needs to check one lane: the row it ran on, whether it must
    sample, the tokens that terminate it (empty with ``ignore_eos``) and its grammar."""

    handle: RequestHandle
    epoch: int
    row: StateRow
    samples: bool
    eos_token_ids: tuple[int, ...]
    grammar: RequestGrammar | None = None
    """The request's grammar matcher (structured output), the one mutable object a
    message refers to: the validator advances it with every valid token, fails a token
    it refuses and ends the request when the grammar is complete. It is safe because a
    constrained request has at most one frame in flight (QUEUE-13) and the planner
    reads it only to build that request's next frame (``actors.grammar``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameOrder:
    """One committed plan to launch (step 4)."""

    fence: Fence
    plan: ScheduledPlan
    frame: Frame | SpeculativeFrame | SpeculativeMixedFrame
    lanes: tuple[LaneContext, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameOutcome:
    """What the device did with one ``FrameOrder``: a completion or a fault."""

    order: FrameOrder
    completion: Completion | None
    fault: ProgramFault | None
    wall_ns: int
    launched_ns: int = 0
    """Runtime clock at launch (``wall_ns`` later the completion was observed)."""


DispatcherInbox = FrameOrder
ValidatorInbox = FrameOutcome


# ------------------------------------------------------------------- publisher


@dataclass(frozen=True, slots=True, kw_only=True)
class Track:
    """Start publishing for a resident request; the publisher now owns ``events``."""

    request_id: RequestId
    handle: RequestHandle
    epoch: int
    request: GenerationRequest
    cached_tokens: int
    events: EventSender
    arrived_ns: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptScoreRecord:
    """A scored prompt, complete: ``logprobs[i]`` scores prompt token ``i + 1`` and
    ``top_logprobs[i]`` holds its first k alternatives (empty when none were asked)."""

    handle: RequestHandle
    logprobs: tuple[float, ...]
    top_logprobs: tuple[Alternatives, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishFrame:
    """Committed output of one frame (``Scheduler.complete``'s tokens), with the
    per-token logprobs (with the top alternatives each request asked for) and any
    failure messages, in one message per fence."""

    fence: Fence
    tokens: tuple[GeneratedToken, ...]
    logprobs: tuple[tuple[float, ...], ...]
    errors: tuple[LaneFailure, ...]
    prompt_scores: tuple[PromptScoreRecord, ...] = ()
    top_logprobs: tuple[tuple[Alternatives, ...], ...] = ()
    """Per entry of ``tokens``, per token: its first k alternatives (k the request's
    ``top_logprobs``; empty when it asked for none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Drop:
    """Stop publishing for a request and end its stream with ``reason``."""

    handle: RequestHandle
    epoch: int
    reason: FinishReason
    message: str = ""
    scheduled_ns: int | None = None
    """Runtime clock when its first frame was submitted (``None``: it never ran)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochRenewed:
    """The request at ``handle`` continues as the same stream under a fresh scheduler
    ``epoch`` (a window snapshot's restore, PRE-32): later output carries it, and
    output or a ``Drop`` of an earlier epoch no longer reaches the stream."""

    handle: RequestHandle
    epoch: int


PublisherInbox = Track | EpochRenewed | PublishFrame | Drop
