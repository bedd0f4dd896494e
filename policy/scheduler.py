"""``Scheduler``: the prepared-graph scheduler's lifecycle (seed module ``scheduler.rs``).

The planner actor owns one ``Scheduler`` and drives it with values and times::

    sched.advance_to(now_ns)
    plan = sched.plan()                       # pure: never mutates state (QUEUE-2)
    if plan is not None and sched.window_ready(plan):
        trace = sched.commit(plan, fence)     # rechecks, never reselects (QUEUE-6, QUEUE-7)
    ...
    tokens = sched.complete(fence, records, timing, round=...)  # validates lanes first
    sched.published_output(handle, fence, host_time_ns)  # or nothing_published(...)
    for handle in sched.take_released(): free its resources

This module owns the lifecycle (``policy.protocol.SchedulingPolicy``): admission,
preemption and phases, commit (participants, epochs, freshness, window gate), completion
(every lane validated before any update; then ``policy/lane_results.py`` and
``policy/frame_records.py``, cost observations, refresh credit) and publication. Its
parts: ``policy/residency.py``, ``policy/estimate_cache.py``,
``policy/terminal_captures.py`` and, with ``SpeculationSettings``,
``policy/round_speculation.py``. Selection is ``policy/selection.py``.

Seed sections: *Planning and the execution queue*, *Service accounting and publication*,
*Funded timing refresh*, *Prerequisites and completion* (terminal retirement).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from policy.checkpoint_allowance import CheckpointAllowance
from policy.config import PolicyConfig
from policy.cost_drift import estimates_for, reconfigured
from policy.credit_ledgers import (
    CreditLedger,
    episode_charge_ns,
    settle_frame,
    timing_refresh_ledger,
)
from policy.decision import build_context, takes_last_row
from policy.descriptors import ExecutionTiming, GraphShape, StateOp
from policy.duration_estimates import DurationEstimates
from policy.estimate_cache import EstimateCache, fair_share_population
from policy.frame_queue import FrameQueue, QueuedFrame
from policy.frame_records import (
    charge_service,
    mark_committed,
    participants,
    publish,
    settle_in_flight,
)
from policy.grammar_feedback import fixed_width_contexts, grammar_plan, with_grammar_feedback
from policy.lane_results import apply_lane_results
from policy.lifecycle import (
    check_admission,
    check_commit,
    check_lane,
    check_stages,
    index_records,
    lane_valid,
)
from policy.protocol import RoundCompletion
from policy.requests import RequestRecord
from policy.residency import EpochRenewal, ExecutionCounters, Residency
from policy.round_speculation import RoundSpeculation, SchedulingView, SpeculationSettings
from policy.rounds import SpeculationMode
from policy.selection import CatalogIndex, ShapeTimes, select
from policy.service import new_history, service_interval_ns
from policy.speculation import AcceptanceState
from policy.terminal_captures import TerminalCaptures
from policy.types import (
    CommitRejected,
    CompletionError,
    CompletionRecord,
    Fence,
    GeneratedToken,
    Phase,
    PolicyError,
    RequestHandle,
    RestoreNeed,
    ScheduledPlan,
    SchedulerStatistics,
    SelectionReason,
    StalePlanError,
    TraceRecord,
)
from policy.utility import NS_PER_MS
from policy.vision_windows import ImagePlan


class Scheduler(EpochRenewal):
    """Pure, synchronous scheduler over one catalog of prepared shapes.

    ``speculation``: plan complete speculative rounds of that proposal source and mode
    (``policy/round_speculation.py``); None: ordinary programs only."""

    def __init__(self, config: PolicyConfig | None = None,
                 catalog: Iterable[GraphShape] = (), *,
                 speculation: SpeculationSettings | None = None) -> None:
        self._speculation = RoundSpeculation(speculation) if speculation is not None else None
        self._config = config if config is not None else PolicyConfig()
        self._estimates = estimates_for(self._config)
        self._refresh: CreditLedger = timing_refresh_ledger()
        self._queue = FrameQueue()
        self._residency: Residency[RequestRecord] = Residency()
        self._records = self._residency.records  # the hot paths read the dict directly
        self._now_ns = 0
        self._last_fence: Fence | None = None
        self._admitted_any = False
        self._catalog = CatalogIndex.build(())
        self._execution = ExecutionCounters()
        self._cache = EstimateCache(self._estimates)
        self._captures = TerminalCaptures()  # checkpoint extra-work allowances (QUEUE-20..24)
        self.set_catalog(catalog)

    # ---- configuration -------------------------------------------------------------

    @property
    def config(self) -> PolicyConfig:
        return self._config

    @property
    def estimates(self) -> DurationEstimates:
        """The cost catalog. ``complete`` feeds it; a caller that seeds it directly
        (tests, preloaded estimates) goes through this property, which drops the
        scheduler's cached per-shape arrays."""
        self._cache.invalidate()
        return self._estimates

    def _shape_times(self) -> ShapeTimes:
        """Per-shape estimate arrays, rebuilt only after estimates change."""
        return self._cache.shape_times(self._catalog)

    @property
    def refresh_ledger(self) -> CreditLedger:
        return self._refresh

    @property
    def speculation(self) -> RoundSpeculation | None:
        """The speculative-round component (None: this scheduler does not speculate)."""
        return self._speculation

    @property
    def learns_acceptance(self) -> bool:
        """Whether it learns acceptance from rounds and counterfactuals: adaptive
        speculation only."""
        spec = self._speculation
        return spec is not None and spec.mode is SpeculationMode.ADAPTIVE

    @property
    def now_ns(self) -> int:
        return self._now_ns

    def configure_policy(self, config: PolicyConfig) -> None:
        """Replace the preferences; only before the first admission (seed: *Policy
        preferences*, OPEN-29)."""
        if self._admitted_any:
            raise PolicyError("configure_policy must be called before the first admission")
        config.validate()
        self._config = config
        self._estimates = reconfigured(self._estimates, config)
        self._cache = EstimateCache(self._estimates)

    def set_catalog(self, shapes: Iterable[GraphShape]) -> None:
        """Load the prepared shapes. Estimates are keyed by shape and survive reloads."""
        unique = tuple(dict.fromkeys(shapes))
        self._catalog = CatalogIndex.build(unique)
        self._cache.invalidate()

    @property
    def catalog(self) -> tuple[GraphShape, ...]:
        return self._catalog.shapes

    # ---- time ------------------------------------------------------------------------

    def advance_to(self, now_ns: int) -> None:
        """Move the clock forward. Marks overruns (OPEN-31) and, when idle (no frame in
        flight and no runnable request, OPEN-8), discards positive refresh credit."""
        if now_ns < self._now_ns:
            raise PolicyError(f"time went backwards: {now_ns} < {self._now_ns}")
        self._now_ns = now_ns
        self._queue.observe_time(now_ns)
        if len(self._queue) == 0 and not any(r.selectable for r in self._records.values()):
            self._refresh.on_idle()
            if self._speculation is not None:
                self._speculation.on_idle()  # LRN-16

    # ---- residency ---------------------------------------------------------------------

    def admit(self, *, prompt_len: int, max_output_tokens: int, cached_prefix_len: int = 0,
              message_ends: Sequence[int] = (), system_end: int | None = None,
              scored_prompt: bool = False, handle: RequestHandle | None = None,
              restore: RestoreNeed = RestoreNeed.NONE,
              further_stages: Sequence[StateOp] = (), grammar_constrained: bool = False,
              grammar_resident: bool = False, images: ImagePlan | None = None,
              decode_prompt_tail: bool = False, arrived_ns: int | None = None) -> RequestHandle:
        """Make a request resident and return its handle. ``cached_prefix_len`` tokens
        were restored from the prefix cache and earn no prompt service (SEL-1).
        ``message_ends`` are message-end token offsets (DUR-20's endpoints); ``system_end``
        ends the system prompt, a boundary no prefill chunk crosses (SEL-40, OPEN-36). A
        reused ``handle`` gets a larger epoch (ACCT-5). ``restore``: READY when its saved
        state must first be restored by a prepared restore graph (a prerequisite pair,
        PRE-1..19); AWAITING while an external restoration runs (``restoration_ready``),
        outside every participant set (ACCT-4). ``further_stages``: prerequisite stages
        after the restore (initialization), each run by its own prepared state graph;
        such a request is ranked by the continuation index (PRE-21..25). ``grammar_*``:
        ``policy.grammar_feedback``; ``images``: ``policy.vision_windows``;
        ``decode_prompt_tail``: ``lifecycle.decodes_prompt_tail``; ``arrived_ns``:
        ``RequestRecord.arrived_ns``."""
        start = check_admission(
            prompt_len=prompt_len, max_output_tokens=max_output_tokens,
            cached_prefix_len=cached_prefix_len, message_ends=message_ends,
            system_end=system_end, decode_prompt_tail=decode_prompt_tail,
            scored_prompt=scored_prompt, has_images=images is not None,
            restores=restore is not RestoreNeed.NONE)
        stages = check_stages(restore, further_stages)
        handle, epoch = self._residency.claim(handle)
        self._residency.add(RequestRecord(
            handle=handle, epoch=epoch, admitted_ns=self._now_ns, prompt_len=prompt_len,
            cached_prefix_len=cached_prefix_len, max_output_tokens=max_output_tokens,
            message_ends=start.message_ends, system_end=system_end, scored_prompt=scored_prompt,
            history=new_history(self._cache.normalizers(fair_share_population(self._catalog))),
            prompt_cursor=start.prompt_cursor, phase=start.phase, restore=restore,
            last_visible_ns=self._now_ns, further_stages=stages, images=images,
            grammar_constrained=grammar_constrained, grammar_resident=grammar_resident,
            arrived_ns=None if arrived_ns is None else min(arrived_ns, self._now_ns),
            took_last_row=takes_last_row(self._records, self._catalog)))
        self._captures.admit(handle, self._config.checkpoint_extra_work_fraction,
                               uncached_tokens=prompt_len - cached_prefix_len,
                               catalog=self._catalog, estimates=self._estimates)
        self._admitted_any = True
        return handle

    def assign_client(self, handle: RequestHandle, client: str) -> None:
        self._records[handle].client = client  # priced only by client_fairness

    def restoration_ready(self, handle: RequestHandle) -> None:
        """External restoration finished: a restore graph may now bind the state."""
        rec = self._record(handle)
        if rec.restore is RestoreNeed.AWAITING:
            rec.restore = RestoreNeed.READY

    def cancel(self, handle: RequestHandle) -> None:
        """Stop selecting ``handle`` at once (QUEUE-8). Its in-flight lanes complete
        without effect; it is released once its last submitted fence completes."""
        self._residency.cancel(handle)

    def preempt(self, handle: RequestHandle) -> None:
        """Begin retiring a resident request without completing its response (PRE-43);
        its terminal age starts now (PRE-41)."""
        self._captures.preempt(self._record(handle), self._catalog, self._estimates,
                                 self._now_ns)

    def phase(self, handle: RequestHandle) -> Phase:
        return self._record(handle).phase

    def request(self, handle: RequestHandle) -> RequestRecord:
        """The live record (read-only use: tests, diagnostics)."""
        return self._record(handle)

    def handles(self) -> tuple[RequestHandle, ...]:
        return tuple(self._records)

    def take_released(self) -> list[RequestHandle]:
        """Handles whose execution resources may now be freed: retired, cancelled or
        failed, with no submitted fence outstanding (PRE-39, PRE-54, QUEUE-9).
        They stop being resident."""
        done = self._residency.release()
        self._captures.release(done)
        if self._speculation is not None:
            self._speculation.release(done)
        return done

    # ---- acceptance (speculation) ------------------------------------------------------

    def _speculating(self) -> RoundSpeculation:
        if self._speculation is None:
            raise PolicyError("this scheduler is not configured to speculate")
        return self._speculation

    def acceptance(self, handle: RequestHandle) -> AcceptanceState:
        """The request's acceptance state (created from the population priors)."""
        spec = self._speculating()
        self._record(handle)
        return spec.acceptance(handle)

    def preseed_acceptance(self, handle: RequestHandle, means: Sequence[float],
                           weight: float = 128.0) -> None:
        """Give a request a preseeded acceptance history (OPEN-34, VER-23)."""
        spec = self._speculating()
        self._record(handle)
        spec.preseed(handle, means, weight)

    def observe_counterfactual(self, handle: RequestHandle, *, offered: int,
                               accepted: int, terminated: bool,
                               survival: Sequence[float] | None = None) -> None:
        """Fold a *counterfactual* round of the configured proposal source (one no
        frame ran, replayed by the host) into the request's acceptance and the
        population prior (``RoundSpeculation.observe_counterfactual``); without
        speculation nothing is learned."""
        if self._speculation is not None:
            self._speculation.observe_counterfactual(
                handle, resident=handle in self._records, offered=offered,
                accepted=accepted, terminated=terminated, survival=survival)

    # ---- planning ----------------------------------------------------------------------

    def plan(self) -> ScheduledPlan | None:
        """The best plan for the window's expected end; None when nothing is runnable.

        Pure (QUEUE-2). The plan may need an empty window (``requires_empty_window``);
        while frames are in flight the planner then submits nothing (QUEUE-34, QUEUE-35).
        """
        times = self._shape_times()
        refresh_funded = self._refresh.funded()
        ctx = build_context(
            records=self._records, catalog=self._catalog, times=times,
            config=self._config, queue=self._queue, now_ns=self._now_ns,
            ttl_ns=self._estimates.ttl_ns, refresh_funded=refresh_funded,
        )
        spec = self._speculation
        fixed = spec is not None and spec.mode is SpeculationMode.FIXED
        plain, ctx = fixed_width_contexts(ctx) if fixed else (ctx, ctx)  # MIX-7, SEL-13
        ordinary = select(plain)
        if spec is None:
            return with_grammar_feedback(ordinary, self._records)  # QUEUE-13
        return grammar_plan(ordinary, spec.plan(ordinary, ctx, SchedulingView(
            now_ns=self._now_ns, records=self._records, queue=self._queue,
            config=self._config, catalog=self._catalog, times=times,
            estimates=self._estimates, refresh_funded=refresh_funded)), self._records)

    def blocking_reason(self, plan: ScheduledPlan) -> str | None:
        """Why ``plan`` cannot be committed into the window now (None: it can)."""
        if len(self._queue) and self._became_unqueueable(plan):
            return f"{plan.shape.label()} went stale since planning; replan"
        return self._queue.blocking_reason(plan)

    def window_ready(self, plan: ScheduledPlan) -> bool:
        return self.blocking_reason(plan) is None

    def window_open(self) -> bool:
        """Whether any plan could be submitted now (``FrameQueue.accepts_more``): False
        while both slots are full, after an overrun, or behind a frame nothing may queue
        behind. A planner skips ``plan()`` then; the next completion reopens it."""
        return self._queue.accepts_more()

    def _became_unqueueable(self, plan: ScheduledPlan) -> bool:
        known = self._estimates.is_known(plan.shape)
        stale = self._estimates.is_stale(plan.shape, self._now_ns)
        return known != plan.duration_known or (stale and not plan.stale)

    def commit(self, plan: ScheduledPlan, fence: Fence) -> TraceRecord:
        """Submit ``plan`` as frame ``fence`` (QUEUE-6, QUEUE-7, ACCT-1, ACCT-2).

        Rechecks epochs, request state, the window gate and freshness (DUR-28); raises a
        ``CommitRejected`` subclass without changing anything when a check fails
        (OPEN-12: drop the plan and replan). A committed acceptance probe opens an
        acceptance episode (LRN-8).
        """
        spec = self._speculation
        if spec is not None:
            spec.check_commit(plan)
        if self._last_fence is not None and fence <= self._last_fence:
            raise CommitRejected(f"fence {fence} is not after {self._last_fence}")
        if len(self._queue) and self._became_unqueueable(plan):
            raise StalePlanError(f"{plan.shape.label()} went stale or was measured since "
                                 "planning and the window is not empty")
        check_commit(plan, fence, last_fence=self._last_fence,
                     blocking=self._queue.blocking_reason(plan))
        for lane in plan.lanes:
            check_lane(self._records.get(lane.handle), lane)
        start = self._queue.expected_end_ns(self._now_ns)
        end = start + plan.estimated_duration_ns
        charged = participants(self._records)
        frame = QueuedFrame(
            fence=fence, plan=plan, committed_ns=self._now_ns, expected_start_ns=start,
            expected_end_ns=end, isolated=len(self._queue) == 0, participants=charged,
            normalizers=self._cache.normalizers(len(charged)), reason=plan.reason,
        )
        if plan.reason is SelectionReason.TIMING_REFRESH:
            self._refresh.begin_episode()
        self._cache.record_attempt(self._catalog, plan.shape, self._now_ns)
        mark_committed(plan, fence, self._records, now_ns=self._now_ns, end_ns=end)
        self._queue.push(frame)
        self._last_fence = fence
        self._execution.committed += 1
        trace = self._execution.trace(
            plan, fence,
            observation_age_ns=self._estimates.observation_age_ns(plan.shape, self._now_ns),
            exploration_credit_ns=float(self._refresh.balance_ns),
            log_scale=plan.selection_log_scale(), now_ns=self._now_ns)
        if spec is not None:
            spec.committed(plan)
        return trace

    # ---- completion ----------------------------------------------------------------------

    def complete(self, fence: Fence, records: Sequence[CompletionRecord],
                 timing: ExecutionTiming, *, round: RoundCompletion | None = None
                 ) -> list[GeneratedToken]:
        """Apply the oldest in-flight frame's validated results.

        Every lane is validated before anything is updated (ACCT-6); a malformed lane
        fails only its own request (``FinishKind.ERROR``). Service comes from committed
        counter differences (ACCT-7); the frame's measured interval feeds every live
        participant, with zero service for unselected ones (ACCT-8..11); deliveries are
        recorded as zero until publication corrects them (ACCT-13).

        ``round``: what a speculative frame's lanes report (QUEUE-3, QUEUE-4, ACC-28);
        a speculating scheduler learns acceptance from it, and a device-allocated round
        cannot complete without it. Without speculation it is ignored.
        """
        head = next(iter(self._queue), None)
        if head is None or head.fence != fence:
            raise CompletionError(f"fence {fence} is not the oldest frame in flight")
        spec = self._speculation
        if spec is not None:
            spec.check_completion(head.plan.shape, round)
        out = self._apply_completion(head, fence, records, timing)
        if spec is not None:
            spec.completed(head, out, timing, round)
        return out

    def _apply_completion(self, head: QueuedFrame, fence: Fence,
                          records: Sequence[CompletionRecord], timing: ExecutionTiming
                          ) -> list[GeneratedToken]:
        by_handle, duplicates = index_records(records)
        verdicts = [(lane, lane_valid(lane, by_handle.get(lane.handle), duplicates))
                    for lane in head.plan.lanes]
        lane_handles = {lane.handle for lane in head.plan.lanes}
        self._execution.failed_lanes += sum(1 for h in by_handle if h not in lane_handles)
        # ---- nothing has changed before this point ----
        self._queue.pop(fence, self._now_ns)
        settle_in_flight(head, fence, self._records, self._queue, self._now_ns)
        self._account_execution(head, timing)
        interval_ns = service_interval_ns(timing, isolated=head.isolated)
        interval_ms = interval_ns / NS_PER_MS
        results = apply_lane_results(
            verdicts, by_handle, fence, residency=self._residency, captures=self._captures,
            cost_sample_ns=timing.cost_sample_ns, retire=self._retire, shape=head.plan.shape)
        self._execution.failed_lanes += results.failed_lanes
        if interval_ns > 0:
            charge_service(head, self._records, results.served_tokens, results.tokens, fence,
                           interval_ms, self._config)
        return results.tokens

    def _retire(self, rec: RequestRecord) -> None:
        """A finished request's terminal capture starts (PRE-41)."""
        self._captures.retire(rec, self._catalog, self._estimates, self._now_ns)

    def checkpoint_allowance(self, handle: RequestHandle) -> CheckpointAllowance:
        """``handle``'s checkpoint allowance ledger (read-only use: tests, diagnostics)."""
        self._record(handle)
        return self._captures[handle]

    def _account_execution(self, frame: QueuedFrame, timing: ExecutionTiming) -> None:
        """Counters by kind, cost learning, refresh credit (DUR-8..19, REF-1..16)."""
        kind = frame.reason
        self._execution.executed(kind, episode_charge_ns(timing, isolated=frame.isolated))
        self._cache.observe(self._catalog, frame.plan.shape, timing.cost_sample_ns,
                            self._now_ns)
        settle_frame(self._refresh, timing, isolated=frame.isolated,
                     ordinary=kind is SelectionReason.ORDINARY,
                     episode=kind is SelectionReason.TIMING_REFRESH)

    # ---- publication -------------------------------------------------------------------

    def published_output(self, handle: RequestHandle, fence: Fence, host_time_ns: int) -> None:
        """Visible output for ``handle`` at ``fence`` reached the client at
        ``host_time_ns``: its output age restarts there (ACCT-18) and the first
        publication for the fence counts as one delivery (ACCT-14, ACCT-15). A burst
        held back by stop buffering is reported with the fence at which it became
        visible (OPEN-20)."""
        rec = self._records.get(handle)
        if rec is not None and not rec.cancelled:
            publish(rec, fence, host_time_ns, self._config)

    def nothing_published(self, handle: RequestHandle, fence: Fence) -> None:
        """The publisher processed ``fence`` for ``handle`` and nothing became visible
        (stop buffering, OPEN-20): the zero-delivery update stands."""
        rec = self._records.get(handle)
        if rec is not None and rec.pending_delivery is not None \
                and rec.pending_delivery.fence == fence:
            rec.pending_delivery = None

    # ---- observation -------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        return self._execution.statistics(
            resident=len(self._records), in_flight=len(self._queue),
            refresh_credit_ns=float(self._refresh.balance_ns))

    def traces(self) -> tuple[TraceRecord, ...]:
        return tuple(self._execution.traces)

    def in_flight(self) -> tuple[Fence, ...]:
        return tuple(f.fence for f in self._queue)

    def _record(self, handle: RequestHandle) -> RequestRecord:
        return self._residency.get(handle)

