"""``BaselinePolicy``: the lifecycle every baseline shares (``policy.protocol.SchedulingPolicy``).

This module owns what a conventional scheduler needs besides its ordering rule, built
on the seed scheduler's own pieces wherever they exist as modules:

- request residency on ``policy.requests.RequestRecord`` (cursors, phase, output room
  net of queued work, the system-prompt boundary, fences in flight), extended with the
  admission order and client tag baselines rank by (``BaselineRequest``);
- the two-slot frame window is ``policy.frame_queue.FrameQueue`` (QUEUE-10..12: only
  generation programs may queue behind generation programs; prefill, mixed and state
  programs drain the window). Baselines never call ``observe_time``: they have no
  overrun rule (OPEN-31 is the seed's);
- execution time per frame is ``policy.credit_ledgers.episode_charge_ns``, as the seed counts it;
- admission checks, commit rechecks (fence order, window, capacity, each lane's epoch and
  cursors), completion validation (every lane before any update, ACCT-6) and applying a
  valid lane's progress are ``policy.lifecycle``'s, as for the seed's ``Scheduler``.

Resident records, execution counters and traces are ``policy.residency``'s, shared
with the seed's ``Scheduler``. What remains here is the baseline record's bookkeeping,
terminal snapshots when the catalog prepares them (PRE-41) and cost observations
(traces and export only: baselines never rank by cost).
Subclasses implement ``_choose`` (pure: reads state, never changes it) and may hook
``_on_admitted``, ``_on_client``, ``_on_served``. Baselines price no deliveries, so
``published_output`` and ``nothing_published`` only check their arguments.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from policy.baselines.menu import PromptWork, ShapeMenu
from policy.config import PolicyConfig
from policy.cost_drift import estimates_for, reconfigured
from policy.credit_ledgers import episode_charge_ns
from policy.descriptors import ExecutionTiming, GraphShape
from policy.duration_estimates import DurationEstimates
from policy.frame_queue import FrameQueue, QueuedFrame
from policy.grammar_feedback import with_grammar_feedback
from policy.lifecycle import (
    apply_progress,
    check_admission,
    check_commit,
    check_lane,
    index_records,
    lane_valid,
)
from policy.protocol import RoundCompletion
from policy.requests import RequestRecord
from policy.residency import EpochRenewal, ExecutionCounters, Residency
from policy.service import FALLBACK_RATE_PER_MS, Normalizers, new_history
from policy.types import (
    CompletionError,
    CompletionRecord,
    Fence,
    FinishKind,
    GeneratedToken,
    Lane,
    LaneRole,
    Phase,
    PolicyError,
    RequestHandle,
    ScheduledPlan,
    ScheduledStep,
    SchedulerStatistics,
    SelectionReason,
    TraceRecord,
)
from policy.vision_windows import ImagePlan

DEFAULT_CLIENT = ""
"""The client of a request nobody tagged."""

_UNPRICED = Normalizers(token_rate_per_ms=FALLBACK_RATE_PER_MS,
                        delivery_rate_per_ms=FALLBACK_RATE_PER_MS)
"""Baselines price nothing: their records and frames carry the fallback normalizers."""


@dataclass(slots=True, kw_only=True)
class BaselineRequest(RequestRecord):
    """One resident request as a baseline sees it: the seed's record plus admission
    order and client. Its service ``history`` is never updated (baselines price
    nothing)."""

    sequence: int
    """Admission order (FCFS order)."""
    client: str = DEFAULT_CLIENT
    rounds: int = 0
    """Commit number of the last frame that carried it (least recently served first)."""

    @property
    def started(self) -> bool:
        """Prompt work has begun (or finished): the request holds a running slot."""
        return self.phase is Phase.DECODE or self.prompt_cursor > self.cached_prefix_len

    @property
    def live(self) -> bool:
        return not self.cancelled and self.phase is not Phase.RETIRED

    def chunk_limit(self) -> int:
        """Prompt tokens up to the logical end: the system boundary if the cursor is
        before it, else the prompt end (SEL-40)."""
        return self.logical_prompt_end() - self.prompt_cursor

    def prompt_work(self, tokens: int) -> PromptWork:
        return PromptWork(self.handle, self.epoch, self.prompt_cursor, tokens,
                          self.prompt_cursor + tokens >= self.prompt_len)


@dataclass(slots=True)
class _View:
    """Resident requests by what they can do now, each list in admission order."""

    prompts: list[BaselineRequest]
    """Prompt work left and no frame in flight."""
    decoders: list[BaselineRequest]
    """Decoding with output room left (net of queued frames)."""
    terminals: list[tuple[RequestHandle, int]]
    """Awaiting their terminal snapshot, no frame in flight."""
    running: int
    """Holding a running slot: prompt begun, or decoding."""

    @staticmethod
    def scan(requests: Iterable[BaselineRequest]) -> _View:
        view = _View([], [], [], 0)
        for r in requests:
            if r.cancelled:
                continue
            phase = r.phase
            if phase is Phase.DECODE:
                view.running += 1
                if r.output_room > 0:
                    view.decoders.append(r)
            elif phase is Phase.PREFILL:
                if r.prompt_cursor > r.cached_prefix_len:
                    view.running += 1
                if not r.in_flight_fences:
                    view.prompts.append(r)
            elif phase is Phase.TERMINAL and not r.in_flight_fences:
                view.terminals.append((r.handle, r.epoch))
        return view


class BaselinePolicy(EpochRenewal, abc.ABC):
    """Shared lifecycle; subclasses decide which step runs next (``_choose``)."""

    name = "baseline"
    rounds_decode = False
    """Whether complete speculative rounds stand in for ordinary decode (``fixed-spec``)."""

    def __init__(self, config: PolicyConfig | None = None, catalog: Iterable[GraphShape] = ()) -> None:
        self._config = config if config is not None else PolicyConfig()
        self._estimates = estimates_for(self._config)
        self._residency: Residency[BaselineRequest] = Residency()
        self._requests = self._residency.records
        self._sequence = 0
        self._now_ns = 0
        self._queue = FrameQueue()
        self._last_fence: Fence | None = None
        self._admitted_any = False
        self._execution = ExecutionCounters()
        self._last_step_had_prompt = False
        self._menu = ShapeMenu.build(())
        self._planning_view: _View | None = None
        self._running_cap: int | None = None
        self.set_catalog(catalog)

    # ---- configuration ---------------------------------------------------------------

    @property
    def config(self) -> PolicyConfig:
        return self._config

    @property
    def estimates(self) -> DurationEstimates:
        return self._estimates

    @property
    def now_ns(self) -> int:
        return self._now_ns

    @property
    def learns_acceptance(self) -> bool:
        """Baselines never learn acceptance (``fixed-spec-K`` runs a fixed depth)."""
        return False

    @property
    def catalog(self) -> tuple[GraphShape, ...]:
        return self._menu.shapes

    @property
    def running_limit(self) -> int:
        """Requests that may hold a running slot (prefilling or decoding) at once:
        ``limit_running``'s cap, else the largest decode batch (like ``max_num_seqs``)."""
        cap = self._running_cap
        return self._own_running_limit() if cap is None else cap

    def _own_running_limit(self) -> int:  # subclass hook: the limit without a cap
        return self._menu.max_decode_batch

    def limit_running(self, limit: int) -> None:
        """Run at most ``limit`` requests at once, whatever the catalog (above the
        largest decode batch they take turns in the policy's decode order)."""
        if limit < 1:
            raise PolicyError(f"running limit must be positive, got {limit}")
        self._running_cap = limit

    def configure_policy(self, config: PolicyConfig) -> None:
        """Replace the preferences before admission (baselines use only the estimates')."""
        if self._admitted_any:
            raise PolicyError("configure_policy must be called before the first admission")
        config.validate()
        self._config = config
        self._estimates = reconfigured(self._estimates, config)

    def set_catalog(self, shapes: Iterable[GraphShape]) -> None:
        menu = ShapeMenu.build(shapes)
        menu.check_usable(rounds=self.rounds_decode)
        self._menu = menu
        self._check_catalog(menu)

    def _check_catalog(self, menu: ShapeMenu) -> None:
        """Subclass hook: refuse a catalog the policy's parameters cannot use."""
        return None

    # ---- time --------------------------------------------------------------------------

    def advance_to(self, now_ns: int) -> None:
        if now_ns < self._now_ns:
            raise PolicyError(f"time went backwards: {now_ns} < {self._now_ns}")
        self._now_ns = now_ns

    # ---- residency ---------------------------------------------------------------------

    def admit(self, *, prompt_len: int, max_output_tokens: int, cached_prefix_len: int = 0,
              message_ends: Sequence[int] = (), system_end: int | None = None,
              scored_prompt: bool = False, handle: RequestHandle | None = None,
              grammar_constrained: bool = False, grammar_resident: bool = False,
              images: ImagePlan | None = None, decode_prompt_tail: bool = False,
              arrived_ns: int | None = None) -> RequestHandle:
        """As ``Scheduler.admit``; message ends, scored prompts and ``arrived_ns`` are
        accepted, then ignored: baselines prefill in admission order within image windows."""
        start = check_admission(
            prompt_len=prompt_len, max_output_tokens=max_output_tokens,
            cached_prefix_len=cached_prefix_len, message_ends=message_ends, system_end=system_end,
            decode_prompt_tail=decode_prompt_tail, scored_prompt=scored_prompt,
            has_images=images is not None)
        handle, epoch = self._residency.claim(handle)
        self._sequence += 1
        req = BaselineRequest(
            handle=handle, epoch=epoch, sequence=self._sequence, admitted_ns=self._now_ns,
            prompt_len=prompt_len, cached_prefix_len=cached_prefix_len,
            max_output_tokens=max_output_tokens, system_end=system_end,
            history=new_history(_UNPRICED), prompt_cursor=start.prompt_cursor, phase=start.phase,
            last_visible_ns=self._now_ns, grammar_constrained=grammar_constrained,
            grammar_resident=grammar_resident, images=images)
        self._on_admitted(req)
        self._residency.add(req)
        self._admitted_any = True
        return handle

    def assign_client(self, handle: RequestHandle, client: str) -> None:
        """Tag a resident request with its client (``admit`` has no client parameter,
        so the tag travels separately; call it right after ``admit``)."""
        req = self._request(handle)
        if req.client == client:
            return
        previous = req.client
        req.client = client
        self._on_client(req, previous)

    def client_of(self, handle: RequestHandle) -> str:
        return self._request(handle).client

    def cancel(self, handle: RequestHandle) -> None:
        self._residency.cancel(handle)

    def preempt(self, handle: RequestHandle) -> None:
        req = self._request(handle)
        if req.live and req.phase is not Phase.TERMINAL:
            self._retire(req)

    def phase(self, handle: RequestHandle) -> Phase:
        return self._request(handle).phase

    def request(self, handle: RequestHandle) -> BaselineRequest:
        """The live record (read-only use: the runtime reads its epoch)."""
        return self._request(handle)

    def handles(self) -> tuple[RequestHandle, ...]:
        return tuple(self._requests)

    def take_released(self) -> list[RequestHandle]:
        return self._residency.release()

    # ---- what subclasses read -------------------------------------------------------

    def _view(self) -> _View:
        """The resident requests sorted by what they can do now: one pass, reused by
        every read of one ``plan()`` (state never changes while planning)."""
        view = self._planning_view
        return view if view is not None else _View.scan(self._requests.values())

    def _prompts(self) -> list[BaselineRequest]:
        """Requests with prompt work and no frame in flight, in admission order."""
        return self._view().prompts

    def _decoders(self) -> list[BaselineRequest]:
        """Decoding requests with output room left, in admission order."""
        return self._view().decoders

    def _running(self) -> int:
        """Requests holding a running slot (prompt begun or decoding)."""
        return self._view().running

    def _may_start(self) -> bool:
        """Whether a request whose prompt has not begun may start now."""
        return self._running() < self.running_limit

    def _terminal_step(self) -> ScheduledStep | None:
        terminals = self._view().terminals
        if not terminals or not self._menu.snapshot:
            return None
        return self._menu.snapshot_step(terminals)

    # ---- planning ----------------------------------------------------------------------

    @abc.abstractmethod
    def _choose(self) -> ScheduledStep | None:
        """The policy's next step from the current state, or None (pure)."""

    def plan(self) -> ScheduledPlan | None:
        """The next step (pure). Terminal snapshots come first: they free resources."""
        if not self._menu.shapes:
            return None
        self._planning_view = _View.scan(self._requests.values())
        try:
            step = self._terminal_step() or self._choose()
        finally:
            self._planning_view = None
        if step is None:
            return None
        estimate = self._estimates.estimate_ns(step.shape)
        tokens = sum(lane.prompt_tokens + lane.token_ceiling for lane in step.lanes)
        return with_grammar_feedback(ScheduledPlan(
            step=step, estimated_duration_ns=estimate, scaled_score=float(tokens),
            scale_exponent=0, duration_known=estimate > 0, stale=False,
            reason=SelectionReason.ORDINARY,
            requires_empty_window=not step.shape.is_generation,
            planned_at_ns=self._now_ns, start_ns=self._now_ns, useful_value=float(tokens),
        ), self._requests)

    def blocking_reason(self, plan: ScheduledPlan) -> str | None:
        """Why ``plan`` cannot enter the two-slot window now (QUEUE-10..12)."""
        return self._queue.blocking_reason(plan)

    def window_ready(self, plan: ScheduledPlan) -> bool:
        return self.blocking_reason(plan) is None

    def window_open(self) -> bool:
        """Whether any plan could be submitted now (``FrameQueue.accepts_more``): False
        while both slots are full, after an overrun, or behind a frame nothing may queue
        behind. A planner skips ``plan()`` then; the next completion reopens it."""
        return self._queue.accepts_more()

    def commit(self, plan: ScheduledPlan, fence: Fence) -> TraceRecord:
        check_commit(plan, fence, last_fence=self._last_fence,
                     blocking=self.blocking_reason(plan))
        lanes, shape = plan.lanes, plan.shape
        for lane in lanes:
            check_lane(self._requests.get(lane.handle), lane)
        self._execution.committed += 1
        had_prompt = False
        for lane in lanes:
            req = self._requests[lane.handle]
            req.in_flight_fences.append(fence)
            req.rounds = self._execution.committed
            if lane.role is LaneRole.DECODE:
                req.queued_outputs += lane.token_ceiling
            elif lane.role is LaneRole.PROMPT:
                had_prompt = True
        self._estimates.record_attempt(shape, self._now_ns)
        start = self._queue.expected_end_ns(self._now_ns)
        self._queue.push(QueuedFrame(
            fence=fence, plan=plan, committed_ns=self._now_ns, expected_start_ns=start,
            expected_end_ns=start + plan.estimated_duration_ns,
            isolated=len(self._queue) == 0, participants=(), normalizers=_UNPRICED,
            reason=plan.reason))
        self._last_fence = fence
        self._last_step_had_prompt = had_prompt
        return self._execution.trace(
            plan, fence, observation_age_ns=self._estimates.observation_age_ns(shape, self._now_ns),
            exploration_credit_ns=0.0, log_scale=0.0, now_ns=self._now_ns)

    # ---- completion --------------------------------------------------------------------

    def complete(self, fence: Fence, records: Sequence[CompletionRecord],
                 timing: ExecutionTiming, *, round: RoundCompletion | None = None
                 ) -> list[GeneratedToken]:
        """Apply the oldest frame's results; malformed lanes fail only their request.
        Baselines learn no acceptance: a speculative frame's ``round`` is ignored."""
        head = next(iter(self._queue), None)
        if head is None or head.fence != fence:
            raise CompletionError(f"fence {fence} is not the oldest frame in flight")
        plan = head.plan
        by_handle, duplicates = index_records(records)
        verdicts = [(lane, lane_valid(lane, by_handle.get(lane.handle), duplicates))
                    for lane in plan.lanes]
        # ---- nothing has changed before this point ----
        self._queue.pop(fence)
        self._execution.executed(SelectionReason.ORDINARY,
                                episode_charge_ns(timing, isolated=head.isolated))
        self._estimates.observe(plan.shape, timing.cost_sample_ns, self._now_ns)
        out: list[GeneratedToken] = []
        for lane, ok in verdicts:
            req = self._requests.get(lane.handle)
            if req is None or req.epoch != lane.epoch:
                continue
            req.in_flight_fences.remove(fence)
            if lane.role is LaneRole.DECODE:
                req.queued_outputs -= lane.token_ceiling
            if req.cancelled or req.failed:
                continue
            if not ok:
                self._execution.failed_lanes += 1
                req.failed = True
                req.phase = Phase.RETIRED
                out.append(GeneratedToken(handle=req.handle, epoch=req.epoch, fence=fence,
                                          token_ids=(), finish=FinishKind.ERROR))
                continue
            if lane.role is LaneRole.DECODE and req.phase is not Phase.DECODE:
                continue  # queued behind the request's final token: discarded
            token = self._apply(req, lane, by_handle[lane.handle], fence)
            if token is not None:
                out.append(token)
        return out

    def _apply(self, req: BaselineRequest, lane: Lane, record: CompletionRecord,
               fence: Fence) -> GeneratedToken | None:
        if lane.role is LaneRole.TERMINAL:
            req.phase = Phase.RETIRED
            return None
        self._on_served(req, lane.prompt_tokens, len(record.token_ids))
        progress = apply_progress(req, lane, record)
        if not progress.emitted:
            return None
        if progress.finish is not None:
            self._retire(req)
        return GeneratedToken(handle=req.handle, epoch=req.epoch, fence=fence,
                              token_ids=record.token_ids, first=progress.first,
                              finish=progress.finish)

    def _retire(self, req: BaselineRequest) -> None:
        """Terminal snapshot pending when the catalog prepares one, else retired."""
        req.phase = Phase.TERMINAL if self._menu.snapshot else Phase.RETIRED

    # ---- hooks ---------------------------------------------------------------------------

    def _on_admitted(self, req: BaselineRequest) -> None:
        """Called before ``req`` becomes resident."""
        return None

    def _on_client(self, req: BaselineRequest, previous: str) -> None:
        """Called after ``req`` was re-tagged from ``previous``."""
        return None

    def _on_served(self, req: BaselineRequest, prompt_tokens: int, output_tokens: int) -> None:
        """Called for every completed lane with the tokens it consumed and produced."""
        return None

    # ---- publication and observation ---------------------------------------------------

    def published_output(self, handle: RequestHandle, fence: Fence, host_time_ns: int) -> None:
        """Baselines keep no delivery prices; publication changes nothing."""
        return None

    def nothing_published(self, handle: RequestHandle, fence: Fence) -> None:
        """Baselines keep no delivery prices; nothing to undo."""
        return None

    def observe_counterfactual(self, handle: RequestHandle, *, offered: int,
                               accepted: int, terminated: bool,
                               survival: Sequence[float] | None = None) -> None:
        """Baselines learn no acceptance; counterfactual rounds teach them nothing."""
        return None

    def statistics(self) -> SchedulerStatistics:
        return self._execution.statistics(resident=len(self._requests),
                                         in_flight=len(self._queue), refresh_credit_ns=0.0)

    def traces(self) -> tuple[TraceRecord, ...]:
        return tuple(self._execution.traces)

    def in_flight(self) -> tuple[Fence, ...]:
        return tuple(f.fence for f in self._queue)

    def _request(self, handle: RequestHandle) -> BaselineRequest:
        return self._residency.get(handle)

