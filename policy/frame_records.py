"""What committing and completing a frame does to the seed scheduler's request records.

``Scheduler.commit`` rechecks the plan and ``Scheduler.complete`` validates every lane
before anything changes; this module holds the record-level steps that follow, each a
function of the records it changes:

- ``participants`` and ``mark_committed``: who a committed frame's interval will be
  charged to (ACCT-1, ACCT-4), and its lanes' fences, queued outputs and expected
  delivery end (ACCT-2, QUEUE-43);

- ``settle_in_flight``: the frame leaves its lanes' in-flight lists and queued outputs;
  a request's queued delivery end stays only while a frame still queued ends there
  (QUEUE-43); each lane's completion time is kept for the stream gap limit (U-13);
- ``apply_setup_lane``: terminal, restore, initialize and vision lanes change phase and
  prerequisites only (PRE-20, PRE-32, PRE-41);
- ``charge_service``: the frame's interval feeds every live participant's service
  history, zero service for unselected ones, and deliveries as zero until publication
  corrects them (ACCT-8..13);
- ``publish``: the first publication for a fence counts as one delivery and restarts
  the output age (ACCT-14, ACCT-15, ACCT-18).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from policy.config import PolicyConfig
from policy.descriptors import GraphShape
from policy.frame_queue import QueuedFrame
from policy.requests import PendingDelivery, RequestRecord
from policy.residency import Residency
from policy.service import ServiceHistory, observe_participants, redo_delivery
from policy.types import (
    Fence,
    GeneratedToken,
    Lane,
    LaneRole,
    Phase,
    RequestHandle,
    RestoreNeed,
    ScheduledPlan,
)
from policy.vision_windows import vision_lane_images

__all__ = [
    "apply_setup_lane",
    "charge_service",
    "mark_committed",
    "participants",
    "publish",
    "settle_in_flight",
]


def participants(records: Mapping[RequestHandle, RequestRecord]
                 ) -> tuple[tuple[RequestHandle, int], ...]:
    """Every live request whose state is resident, with its epoch."""
    return tuple((h, r.epoch) for h, r in records.items()
                 if r.phase is not Phase.RETIRED and not r.cancelled
                 and r.restore is not RestoreNeed.AWAITING)


def mark_committed(plan: ScheduledPlan, fence: Fence,
                   records: Mapping[RequestHandle, RequestRecord], *, now_ns: int,
                   end_ns: int) -> None:
    """``plan`` was committed as ``fence`` at ``now_ns``, expected to end at ``end_ns``."""
    for lane in plan.lanes:
        rec = records[lane.handle]
        rec.in_flight_fences.append(fence)
        rec.last_served_ns = now_ns
        if lane.role is LaneRole.DECODE:
            rec.queued_outputs += lane.token_ceiling
            rec.queued_delivery_end_ns = end_ns


def settle_in_flight(head: QueuedFrame, fence: Fence,
                     records: Mapping[RequestHandle, RequestRecord],
                     queued: Iterable[QueuedFrame], now_ns: int) -> None:
    """``head`` (frame ``fence``) completed at ``now_ns``; ``queued`` are the frames
    still in flight."""
    # Expected ends of the frames still queued, per handle they carry (QUEUE-43).
    queued_ends: dict[RequestHandle, set[int]] = {}
    for frame in queued:
        for lane in frame.plan.lanes:
            queued_ends.setdefault(lane.handle, set()).add(frame.expected_end_ns)
    decode = LaneRole.DECODE
    for lane in head.plan.lanes:
        rec = records.get(lane.handle)
        if rec is None or rec.epoch != lane.epoch:
            continue
        rec.in_flight_fences.remove(fence)
        rec.last_completed_ns = now_ns
        if lane.role is decode:
            rec.queued_outputs -= lane.token_ceiling
            if rec.queued_delivery_end_ns not in queued_ends.get(rec.handle, ()):
                rec.queued_delivery_end_ns = None


def apply_setup_lane(rec: RequestRecord, lane: Lane,
                     residency: Residency[RequestRecord], shape: GraphShape) -> bool:
    """Apply a terminal, restore, initialize or vision lane (True); False for any other
    lane. A vision lane's images are encoded (``vision_windows.vision_lane_images`` in
    ``shape``); setup earns no tokens (PRE-20)."""
    if lane.role is LaneRole.VISION and rec.images is not None:
        rec.images_encoded = vision_lane_images(rec.images, lane.prompt_start,
                                                shape.batch_capacity).stop
        return True
    if lane.role is LaneRole.TERMINAL:
        rec.phase = Phase.RETIRED
        return True
    if lane.role is LaneRole.RESTORE:
        # Restore binds the state to a fresh generation (PRE-32); setup earns no
        # tokens (PRE-20). Read the new epoch from ``request(handle).epoch``.
        rec.restored = True
        if not rec.further_stages:
            rec.restore = RestoreNeed.NONE
        residency.renew_epoch(rec)
        return True
    if lane.role is LaneRole.INITIALIZE:
        rec.further_stages = rec.further_stages[1:]  # a later stage of the chain
        if not rec.further_stages:
            rec.restore = RestoreNeed.NONE
        return True
    return False


def charge_service(frame: QueuedFrame, records: Mapping[RequestHandle, RequestRecord],
                   served: Mapping[RequestHandle, int], out: Iterable[GeneratedToken],
                   fence: Fence, interval_ms: float, config: PolicyConfig) -> None:
    """``served``: tokens each selected request consumed and produced; ``out``: the
    frame's emitted bursts."""
    delivered = {t.handle for t in out if t.token_ids}
    live: list[tuple[ServiceHistory, int]] = []
    for handle, epoch in frame.participants:
        rec = records.get(handle)
        if rec is None or rec.epoch != epoch or rec.cancelled or rec.failed:
            continue
        h = rec.history
        live.append((h, served.get(handle, 0)))
        if handle in delivered:
            # The delivery rate before this interval's zero-delivery update (the
            # token update does not touch it).
            rec.pending_delivery = PendingDelivery(fence, h.delivery_rate, interval_ms)
    # observe_service(tokens) then observe_delivery(0) per participant (ACCT-8..13).
    observe_participants(live, interval_ms=interval_ms, config=config)


def publish(rec: RequestRecord, fence: Fence, host_time_ns: int,
            config: PolicyConfig) -> None:
    """Visible output of ``rec`` at ``fence`` reached the client at ``host_time_ns``."""
    rec.last_visible_ns = max(rec.last_visible_ns, host_time_ns)
    pending = rec.pending_delivery
    if pending is not None and pending.fence == fence:
        redo_delivery(rec.history, before=pending.before, deliveries=1,
                      interval_ms=pending.interval_ms, config=config)
        rec.pending_delivery = None
