"""Applying a completed frame's validated lanes to the seed scheduler's request records.

``Scheduler.complete`` validates every lane and settles the frame's queue state first;
``apply_lane_results`` then walks the lanes in plan order:

- a lane of a cancelled, failed or re-admitted request is dropped: its publication is
  suppressed and nothing is charged to it (ACCT-5);
- a lane that failed validation fails only its own request (``FinishKind.ERROR``);
- a decode lane queued behind the request's final token is discarded;
- productive decode earns terminal-capture allowance (QUEUE-23);
- setup lanes change phase and prerequisites only (``frame_records.apply_setup_lane``);
  every other lane advances the request (``lifecycle.apply_progress``), and a lane that
  finishes it starts its terminal capture (``retire``).

It returns the generated tokens, each served request's token count (for
``frame_records.charge_service``) and how many lanes failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policy.descriptors import GraphShape
from policy.frame_records import apply_setup_lane
from policy.lifecycle import apply_progress
from policy.requests import RequestRecord
from policy.residency import Residency
from policy.terminal_captures import TerminalCaptures
from policy.types import (
    CompletionRecord,
    Fence,
    FinishKind,
    GeneratedToken,
    Lane,
    LaneRole,
    Phase,
    RequestHandle,
)


@dataclass(frozen=True, slots=True)
class LaneResults:
    tokens: list[GeneratedToken]
    served_tokens: dict[RequestHandle, int]
    failed_lanes: int


def apply_lane_results(verdicts: Sequence[tuple[Lane, bool]],
                       by_handle: Mapping[RequestHandle, CompletionRecord], fence: Fence, *,
                       residency: Residency[RequestRecord], captures: TerminalCaptures,
                       cost_sample_ns: int, retire: Callable[[RequestRecord], None],
                       shape: GraphShape) -> LaneResults:
    """The validated ``verdicts`` (lane, valid) of the frame at ``fence``, applied."""
    records = residency.records
    served_tokens: dict[RequestHandle, int] = {}
    out: list[GeneratedToken] = []
    failed = 0
    for lane, valid in verdicts:
        rec = records.get(lane.handle)
        if rec is None or rec.epoch != lane.epoch or rec.cancelled or rec.failed:
            continue
        if not valid:
            failed += 1
            rec.failed = True
            rec.phase = Phase.RETIRED
            out.append(GeneratedToken(handle=rec.handle, epoch=rec.epoch, fence=fence,
                                      token_ids=(), finish=FinishKind.ERROR))
            continue
        record = by_handle[lane.handle]
        if lane.role is LaneRole.DECODE and rec.phase is not Phase.DECODE:
            continue
        allowance = captures.get(rec.handle)
        if lane.role is LaneRole.DECODE and allowance is not None:
            allowance.earn_decode(cost_sample_ns)
        served_tokens[rec.handle] = lane.prompt_tokens + len(record.token_ids)
        if apply_setup_lane(rec, lane, residency, shape):
            continue
        progress = apply_progress(rec, lane, record)
        if not progress.emitted:
            continue
        if progress.finish is not None:
            retire(rec)
        out.append(GeneratedToken(handle=rec.handle, epoch=rec.epoch, fence=fence,
                                  token_ids=record.token_ids, first=progress.first,
                                  finish=progress.finish))
    return LaneResults(out, served_tokens, failed)
