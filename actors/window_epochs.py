"""The fresh request generation a window snapshot's restore begins (PRE-32).

A boundary frame (``actors.window_snapshots.snapshot_point``) restores the request's
row from its private snapshot row, so the row it runs on holds a new generation of the
request's state. The request's scheduler epoch moves with it, through the mechanism a
restore lane uses (``SchedulingPolicy.renew_epoch``): before the frame is packed and
committed, the planner renews the epoch in the policy, in its ``LaneSource`` (which the
frame's lane contexts and later drops read) and in the publisher's stream
(``EpochRenewed``), and rebinds the plan's lanes to it (``policy.with_epoch``). So
the boundary frame's own lanes carry the new epoch, and any lane, completion, token or
drop of the old epoch is rejected where it arrives: at commit, in the policy's
completion, in the planner (``frame_inputs.settled`` and its epoch checks) and in the
publisher. The request stays one logical request (PRE-34): one handle, one stream,
its prompt, seed, sampling and usage.

Nothing of the old epoch is outstanding when it changes: a boundary lane runs only
with no frame of the request in flight (PRE-31; the policy refuses a renewal
otherwise), and a boundary falls inside the prompt, before the request has any output.
A plan the commit then refuses leaves the three in the new epoch; the next plan
renews it again.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from actors.frame_inputs import LaneSource
from actors.messages import EpochRenewed, PublisherInbox
from actors.window_snapshots import snapshot_point
from policy import RequestHandle, ScheduledPlan, SchedulingPolicy, with_epoch

__all__ = ["renew_window_epochs"]


async def renew_window_epochs(plan: ScheduledPlan, sources: Mapping[RequestHandle, LaneSource],
                              policy: SchedulingPolicy,
                              publisher: trio.MemorySendChannel[PublisherInbox]
                              ) -> ScheduledPlan:
    """``plan``, its window boundary lanes' requests renewed into fresh epochs (in
    ``policy``, ``sources`` and the ``publisher``) and its lanes carrying them."""
    for lane in plan.lanes:
        source = sources[lane.handle]
        if snapshot_point(lane, source.image_plan, window=source.window,
                          initialised=source.initialised) is None:
            continue
        source.epoch = policy.renew_epoch(lane.handle)
        plan = with_epoch(plan, lane.handle, source.epoch)
        await publisher.send(EpochRenewed(handle=lane.handle, epoch=source.epoch))
    return plan
