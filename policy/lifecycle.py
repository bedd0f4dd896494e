"""Request lifecycle rules every policy shares: the seed's ``Scheduler`` and the baselines.

This module owns the rules that do not depend on how a policy ranks work:

- the context limit (``context_limit``, ``fits_context``, ``context_room``): how many
  positions, prompt plus ``max_tokens``, one request may use; the HTTP layer and the
  runtime's admission both ask these, so they refuse exactly the same requests;
- admission checks (``check_admission``): prompt, output limit, cached prefix, message
  ends and the system boundary (SEL-1, SEL-40, OPEN-36), and where the request starts
  (a one-token uncached remainder may start decoding, ``decodes_prompt_tail``);
- commit rechecks (``check_commit``, ``check_lane``): fences strictly increase, the
  window accepts the plan (QUEUE-10..12), lanes fit the shape, and every lane still
  matches its request's epoch, phase and cursors (QUEUE-6, QUEUE-7, ACCT-5);
- completion validation (``index_records``, ``lane_valid``): every lane is checked
  against its record before anything is updated (ACCT-6); a malformed lane fails only
  its own request;
- applying a valid prompt or output lane (``apply_progress``): cursors, the first token,
  output counts and how the output ended (``FinishKind``).

Pure: values in, values or exceptions out; the caller owns its records and counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from policy.descriptors import MAX_REQUEST_SLOTS, StateOp
from policy.requests import RequestRecord
from policy.types import (
    AdmissionRefused,
    CommitRejected,
    CompletionRecord,
    Fence,
    FinishKind,
    Lane,
    LaneRole,
    Phase,
    RequestHandle,
    RestoreNeed,
    ScheduledPlan,
    StaleEpochError,
    StalePlanError,
    WindowNotReady,
)

__all__ = [
    "Admission",
    "Progress",
    "apply_progress",
    "check_admission",
    "check_commit",
    "check_lane",
    "context_limit",
    "context_room",
    "decodes_prompt_tail",
    "fits_context",
    "index_records",
    "lane_valid",
]


def context_limit(*, max_context: int, num_pages: int, page_size: int) -> int:
    """The most positions (prompt plus ``max_tokens``) one request may use: the served
    context, capped by the whole page pool (a worst case beyond the pool could never be
    granted)."""
    return min(max_context, num_pages * page_size)


def fits_context(*, prompt_len: int, max_tokens: int, limit: int) -> bool:
    """Whether a prompt of ``prompt_len`` tokens plus ``max_tokens`` fits ``limit``
    (``context_limit``); the boundary itself fits."""
    return prompt_len + max_tokens <= limit


def context_room(*, prompt_len: int, limit: int) -> int:
    """The largest ``max_tokens`` that ``fits_context`` for this prompt (below 1: the
    prompt alone fills the context)."""
    return limit - prompt_len


class Admission(NamedTuple):
    """An admissible request's message ends (sorted, unique) and where it starts: PREFILL
    at its cached prefix, or DECODE with the prompt consumed (``decodes_prompt_tail``)."""

    message_ends: tuple[int, ...]
    phase: Phase
    prompt_cursor: int


def check_admission(*, prompt_len: int, max_output_tokens: int, cached_prefix_len: int,
                    message_ends: Sequence[int], system_end: int | None,
                    decode_prompt_tail: bool = False, scored_prompt: bool = False,
                    has_images: bool = False, restores: bool = False) -> Admission:
    """Refuse an inadmissible request (``AdmissionRefused``), ``decode_prompt_tail``
    included where ``decodes_prompt_tail`` does not hold; else say where it starts."""
    if prompt_len < 1:
        raise AdmissionRefused("a request needs at least one prompt token")
    if max_output_tokens < 1:
        raise AdmissionRefused("max_output_tokens must be at least 1")
    if not 0 <= cached_prefix_len < prompt_len:
        raise AdmissionRefused("cached prefix must leave at least one prompt token")
    ends = tuple(sorted(set(message_ends)))
    if any(not 0 < e <= prompt_len for e in ends):
        raise AdmissionRefused("message ends must lie within the prompt")
    if system_end is not None and not 0 < system_end <= prompt_len:
        raise AdmissionRefused("system_end must lie within the prompt")
    if not decode_prompt_tail:
        return Admission(ends, Phase.PREFILL, cached_prefix_len)
    if not decodes_prompt_tail(prompt_len=prompt_len, cached_prefix_len=cached_prefix_len,
                               scored_prompt=scored_prompt, has_images=has_images,
                               restores=restores):
        raise AdmissionRefused("only a one-token uncached prompt without scores, images or "
                               "a restore can start decoding")
    return Admission(ends, Phase.DECODE, prompt_len)


def decodes_prompt_tail(*, prompt_len: int, cached_prefix_len: int, scored_prompt: bool,
                        has_images: bool, restores: bool = False) -> bool:
    """Whether a request's one uncached prompt token can be its first decode step's
    input instead of a prompt chunk (flare's extension, not the seed's: the step feeds
    the last prompt token at its position and samples the first output, exactly what a
    one-token final chunk computes). Not for a scored prompt (its scores come from
    prefill), a prompt with images (their features enter through prompt lanes) or a
    request whose state is first restored (``restores``)."""
    return (prompt_len - cached_prefix_len == 1 and not scored_prompt and not has_images
            and not restores)


def check_stages(restore: RestoreNeed, further_stages: Sequence[StateOp]
                 ) -> tuple[StateOp, ...]:
    """Refuse prerequisite stages without a restore, or of another kind than restore
    and initialize graphs; return them as a tuple."""
    stages = tuple(further_stages)
    if stages and restore is RestoreNeed.NONE:
        raise AdmissionRefused("further prerequisite stages need a restore first")
    if any(op not in (StateOp.RESTORE, StateOp.INITIALIZE) for op in stages):
        raise AdmissionRefused("prerequisite stages are restore or initialize graphs")
    return stages


def check_commit(plan: ScheduledPlan, fence: Fence, *, last_fence: Fence | None,
                 blocking: str | None) -> None:
    """The frame-level commit checks: fence order, the window's verdict (``blocking``,
    from ``FrameQueue.blocking_reason``) and the shape's request capacity."""
    if last_fence is not None and fence <= last_fence:
        raise CommitRejected(f"fence {fence} is not after {last_fence}")
    if blocking is not None:
        raise WindowNotReady(blocking)
    if len(plan.lanes) > min(plan.shape.batch_capacity, MAX_REQUEST_SLOTS):
        raise CommitRejected("plan exceeds the shape's request capacity")


def check_lane(rec: RequestRecord | None, lane: Lane) -> None:
    """Whether ``lane`` may still run for ``rec`` (the resident record of its handle)."""
    if rec is None or rec.epoch != lane.epoch or rec.cancelled:
        raise StaleEpochError(f"request {lane.handle} epoch {lane.epoch} is not live")
    role = lane.role
    if role is LaneRole.PROMPT:
        ok = (rec.phase is Phase.PREFILL and not rec.in_flight
              and rec.prompt_cursor == lane.prompt_start and lane.prompt_tokens > 0
              and lane.prompt_start + lane.prompt_tokens <= rec.prompt_len)
    elif role is LaneRole.DECODE:
        ok = rec.phase is Phase.DECODE and rec.output_room >= lane.token_ceiling
    elif role in (LaneRole.RESTORE, LaneRole.INITIALIZE):
        wanted = StateOp.RESTORE if role is LaneRole.RESTORE else StateOp.INITIALIZE
        ok = rec.restorable and rec.next_stage is wanted
    elif role is LaneRole.VISION:  # its due images, unchanged since planning
        due = rec.vision_due()
        ok = rec.phase is Phase.PREFILL and not rec.in_flight and bool(due) \
            and due.start == lane.prompt_start
    else:
        ok = rec.phase is Phase.TERMINAL and not rec.in_flight
    if not ok:
        raise StalePlanError(f"request {lane.handle} changed since planning")


def index_records(records: Sequence[CompletionRecord]
                  ) -> tuple[dict[RequestHandle, CompletionRecord], set[RequestHandle]]:
    """Records by handle, and the handles reported more than once (all invalid)."""
    by_handle: dict[RequestHandle, CompletionRecord] = {}
    duplicates: set[RequestHandle] = set()
    for r in records:
        if r.handle in by_handle:
            duplicates.add(r.handle)
        by_handle[r.handle] = r
    return by_handle, duplicates


def lane_valid(lane: Lane, record: CompletionRecord | None,
               duplicates: set[RequestHandle]) -> bool:
    """Whether ``record`` is a well-formed result of ``lane`` (ACCT-6): a prompt lane
    consumed exactly its tokens and sampled its token only at the prompt end; an output
    lane committed between one token and its ceiling; setup and terminal lanes none."""
    if record is None or lane.handle in duplicates or not record.ok:
        return False
    if record.epoch != lane.epoch:
        return False
    if lane.role is LaneRole.PROMPT:
        return (record.prompt_tokens == lane.prompt_tokens
                and len(record.token_ids) == lane.token_ceiling)
    if record.prompt_tokens != 0:
        return False
    if lane.role is LaneRole.DECODE:
        return 1 <= len(record.token_ids) <= lane.token_ceiling
    return not record.token_ids


class Progress(NamedTuple):
    """What a valid prompt or output lane did: ``emitted`` is False for a prompt chunk
    short of the prompt end (nothing to publish)."""

    emitted: bool
    first: bool = False
    finish: FinishKind | None = None


def apply_progress(rec: RequestRecord, lane: Lane, record: CompletionRecord) -> Progress:
    """Advance ``rec`` by a valid PROMPT or DECODE lane: the prompt cursor (the request
    starts decoding once the prompt is consumed), committed output, and how the output
    ended: STOP on a terminated record, LENGTH at ``max_output_tokens``. The caller
    retires a finished request (terminal snapshot or release)."""
    if lane.role is LaneRole.PROMPT:
        rec.prompt_cursor += lane.prompt_tokens
        if rec.prompt_cursor < rec.prompt_len:
            return Progress(emitted=False)
        rec.phase = Phase.DECODE
    first = rec.output_committed == 0
    rec.output_committed += len(record.token_ids)
    finish: FinishKind | None = None
    if record.terminated:
        finish = FinishKind.STOP
    elif rec.output_committed >= rec.max_output_tokens:
        finish = FinishKind.LENGTH
    return Progress(emitted=True, first=first, finish=finish)
