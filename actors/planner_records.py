"""What the planner records of the frames it ran: counters, the frame log, traces.

``PlannerCounters`` and the ``FrameRecord`` log feed ``Runtime.statistics()`` and
``Runtime.frame_log()``; ``log_trace`` writes the scheduler's trace of every committed
plan to the debug log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from policy import Fence, TraceRecord

log = structlog.get_logger("flare.planner")


FRAME_LOG_LENGTH = 4096
"""Completed frames kept for ``Runtime.frame_log()`` (benchmarks, diagnostics)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameRecord:
    """One completed frame as the runtime saw it (runtime clock, nanoseconds)."""

    fence: Fence
    graph: str
    lanes: int
    launched_ns: int
    observed_ns: int
    device_ns: int


@dataclass(slots=True)
class PlannerCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    """Prompt tokens of admitted requests that looked their prompt up in the cache."""
    frames: int = 0
    window_snapshots: int = 0
    """Window snapshots run (each with its restore, ``actors.window_snapshots``)."""
    speculative_frames: int = 0
    """Complete speculative programs run and validated."""
    drafted_tokens: int = 0
    """Drafts the proposal source supplied and the target verified."""
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    """``[k]``: rounds whose draft at position ``k`` (0-based) was accepted."""
    counterfactual_rounds: int = 0
    """Counterfactual rounds decided (``actors.acceptance_observations``)."""
    counterfactual_drafted_tokens: int = 0
    """Drafts those rounds offered."""
    counterfactual_accepted_tokens: int = 0
    """Drafts of those rounds that equalled the following tokens."""


def log_trace(trace: TraceRecord) -> None:
    """The scheduler trace: one record per committed plan with the seed's fields
    (ACC-32: physical B/D/W/P, selected cost, observation age, selection reason,
    exploration credit). Debug level: it is per frame."""
    shape = trace.shape
    log.debug(
        "scheduler.trace", fence=int(trace.fence), graph=shape.label(),
        kind=shape.kind.value, batch=shape.batch_capacity, depth=shape.proposal_depth,
        width=shape.token_capacity, packed=shape.packed_capacity, lanes=trace.lanes,
        selected_cost_ns=trace.selected_cost_ns, observation_age_ns=trace.observation_age_ns,
        reason=trace.reason.value, exploration_credit_ns=trace.exploration_credit_ns,
        value_rate=trace.value_rate, log_scale=trace.log_scale,
    )
