"""``BaselinePolicy``: the lifecycle every baseline shares, behind the ``Planner`` interface.

This module owns what a conventional scheduler needs besides its ordering rule:
request residency (admission, client tags, cancellation, phases, release), the
two-slot frame window (QUEUE-10..12: only ordinary decode may queue behind ordinary
decode; prefill, mixed and state programs drain the window), commit rechecks (epochs,
cursors, fence order), completion (every lane validated before any update, ACCT-6;
terminal snapshots when the catalog prepares them, PRE-41), execution counters, cost
observations (kept for traces and export only: baselines never rank by cost) and the
trace of every committed plan.

Subclasses implement ``_choose`` (pure: it reads state, never changes it) and may hook
``_on_admitted``, ``_on_client`` and ``_on_served``. Baselines do not price deliveries,
so ``published_output`` and ``nothing_published`` only check their arguments.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from policy.baselines.menu import PromptWork, ShapeMenu
from policy.config import PolicyConfig
from policy.cost import DurationEstimates
from policy.descriptors import MAX_REQUEST_SLOTS, ExecutionTiming, GraphShape
from policy.types import (
    AdmissionRefused,
    CommitRejected,
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
    StaleEpochError,
    StalePlanError,
    TraceRecord,
    UnknownRequestError,
    WindowNotReady,
)

DEFAULT_CLIENT = ""
"""The client of a request nobody tagged."""

TRACE_HISTORY = 1024
FRAME_SLOTS = 2


@dataclass(slots=True, kw_only=True)
class BaselineRequest:
    """One resident request as a baseline sees it."""

    handle: RequestHandle
    epoch: int
    sequence: int
    """Admission order (FCFS order)."""
    client: str
    prompt_len: int
    cached_prefix_len: int
    max_output_tokens: int
    system_end: int | None
    phase: Phase = Phase.PREFILL
    prompt_cursor: int = 0
    output_committed: int = 0
    queued_outputs: int = 0
    in_flight: list[Fence] = field(default_factory=list)
    cancelled: bool = False
    failed: bool = False

    @property
    def output_room(self) -> int:
        return self.max_output_tokens - self.output_committed - self.queued_outputs

    @property
    def started(self) -> bool:
        """Prompt work has begun (or finished): the request holds a running slot."""
        return self.phase is Phase.DECODE or self.prompt_cursor > self.cached_prefix_len

    @property
    def live(self) -> bool:
        return not self.cancelled and self.phase not in (Phase.RETIRED,)

    def chunk_limit(self) -> int:
        """Prompt tokens up to the logical end: the system boundary if the cursor is
        before it, else the prompt end (SEL-40)."""
        end = self.prompt_len
        if self.system_end is not None and self.prompt_cursor < self.system_end:
            end = min(self.system_end, self.prompt_len)
        return end - self.prompt_cursor

    def prompt_work(self, tokens: int) -> PromptWork:
        return PromptWork(self.handle, self.epoch, self.prompt_cursor, tokens,
                          self.prompt_cursor + tokens >= self.prompt_len)


class BaselinePolicy(abc.ABC):
    """Shared lifecycle; subclasses decide which step runs next (``_choose``)."""

    name = "baseline"

    def __init__(self, config: PolicyConfig | None = None,
                 catalog: Iterable[GraphShape] = ()) -> None:
        self._config = config if config is not None else PolicyConfig()
        self._estimates = DurationEstimates(self._config.estimate_ttl_ns)
        self._requests: dict[RequestHandle, BaselineRequest] = {}
        self._last_epoch: dict[RequestHandle, int] = {}
        self._next_handle = 1
        self._sequence = 0
        self._now_ns = 0
        self._frames: deque[tuple[Fence, ScheduledPlan]] = deque()
        self._last_fence: Fence | None = None
        self._admitted_any = False
        self._executions = {r.value: 0 for r in SelectionReason}
        self._execution_ns = {r.value: 0 for r in SelectionReason}
        self._committed = 0
        self._failed_lanes = 0
        self._traces: deque[TraceRecord] = deque(maxlen=TRACE_HISTORY)
        self._last_step_had_prompt = False
        self._menu = ShapeMenu.build(())
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
    def catalog(self) -> tuple[GraphShape, ...]:
        return self._menu.shapes

    @property
    def running_limit(self) -> int:
        """Requests that may hold a running slot (prefilling or decoding) at once: the
        largest decode batch, like ``max_num_seqs`` in conventional servers."""
        return self._menu.max_decode_batch

    def configure_policy(self, config: PolicyConfig) -> None:
        """Replace the preferences before the first admission (baselines only use the
        estimate freshness interval)."""
        if self._admitted_any:
            raise PolicyError("configure_policy must be called before the first admission")
        config.validate()
        self._config = config
        self._estimates.ttl_ns = config.estimate_ttl_ns

    def set_catalog(self, shapes: Iterable[GraphShape]) -> None:
        menu = ShapeMenu.build(shapes)
        menu.check_usable()
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
              scored_prompt: bool = False, handle: RequestHandle | None = None
              ) -> RequestHandle:
        """Make a request resident (same contract as ``Scheduler.admit``; message ends
        and scored prompts are accepted and ignored: baselines run ordinary prefill)."""
        if prompt_len < 1:
            raise AdmissionRefused("a request needs at least one prompt token")
        if max_output_tokens < 1:
            raise AdmissionRefused("max_output_tokens must be at least 1")
        if not 0 <= cached_prefix_len < prompt_len:
            raise AdmissionRefused("cached prefix must leave at least one prompt token")
        if system_end is not None and not 0 < system_end <= prompt_len:
            raise AdmissionRefused("system_end must lie within the prompt")
        if handle is None:
            handle = RequestHandle(self._next_handle)
        if handle in self._requests:
            raise AdmissionRefused(f"handle {handle} is already resident")
        self._next_handle = max(self._next_handle, handle + 1)
        epoch = self._last_epoch.get(handle, -1) + 1
        self._last_epoch[handle] = epoch
        self._sequence += 1
        req = BaselineRequest(
            handle=handle, epoch=epoch, sequence=self._sequence, client=DEFAULT_CLIENT,
            prompt_len=prompt_len, cached_prefix_len=cached_prefix_len,
            max_output_tokens=max_output_tokens, system_end=system_end,
            prompt_cursor=cached_prefix_len,
        )
        self._on_admitted(req)
        self._requests[handle] = req
        self._admitted_any = True
        return handle

    def assign_client(self, handle: RequestHandle, client: str) -> None:
        """Tag a resident request with its client (``Scheduler.admit`` has no client
        parameter, so the tag travels separately; call it right after ``admit``)."""
        req = self._request(handle)
        if req.client == client:
            return
        previous = req.client
        req.client = client
        self._on_client(req, previous)

    def client_of(self, handle: RequestHandle) -> str:
        return self._request(handle).client

    def cancel(self, handle: RequestHandle) -> None:
        req = self._request(handle)
        req.cancelled = True
        req.phase = Phase.RETIRED

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
        done = [h for h, r in self._requests.items()
                if r.phase is Phase.RETIRED and not r.in_flight]
        for h in done:
            del self._requests[h]
        return done

    # ---- what subclasses read -------------------------------------------------------

    def _prompts(self) -> list[BaselineRequest]:
        """Requests with prompt work and no frame in flight, in admission order."""
        return [r for r in self._requests.values()
                if r.phase is Phase.PREFILL and not r.cancelled and not r.in_flight]

    def _decoders(self) -> list[BaselineRequest]:
        """Decoding requests with output room left, in admission order."""
        return [r for r in self._requests.values()
                if r.phase is Phase.DECODE and not r.cancelled and r.output_room > 0]

    def _running(self) -> int:
        return sum(1 for r in self._requests.values()
                   if r.started and r.phase in (Phase.PREFILL, Phase.DECODE)
                   and not r.cancelled)

    def _may_start(self) -> bool:
        """Whether a request whose prompt has not begun may start now."""
        return self._running() < self.running_limit

    def _terminal_step(self) -> ScheduledStep | None:
        terminals = [(r.handle, r.epoch) for r in self._requests.values()
                     if r.phase is Phase.TERMINAL and not r.cancelled and not r.in_flight]
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
        step = self._terminal_step() or self._choose()
        if step is None:
            return None
        estimate = self._estimates.estimate_ns(step.shape)
        tokens = sum(lane.prompt_tokens + lane.token_ceiling for lane in step.lanes)
        return ScheduledPlan(
            step=step, estimated_duration_ns=estimate, scaled_score=float(tokens),
            scale_exponent=0, duration_known=estimate > 0, stale=False,
            reason=SelectionReason.ORDINARY,
            requires_empty_window=not step.shape.is_generation,
            planned_at_ns=self._now_ns, start_ns=self._now_ns, useful_value=float(tokens),
        )

    def blocking_reason(self, plan: ScheduledPlan) -> str | None:
        """Why ``plan`` cannot enter the two-slot window now (QUEUE-10..12)."""
        if not self._frames:
            return None
        if len(self._frames) >= FRAME_SLOTS:
            return "both frame slots are occupied"
        if plan.requires_empty_window:
            return f"{plan.shape.label()} needs an empty window"
        tail = self._frames[-1][1]
        if tail.requires_empty_window or not tail.shape.is_generation:
            return f"nothing may queue behind {tail.shape.label()}"
        return None

    def window_ready(self, plan: ScheduledPlan) -> bool:
        return self.blocking_reason(plan) is None

    def commit(self, plan: ScheduledPlan, fence: Fence) -> TraceRecord:
        if self._last_fence is not None and fence <= self._last_fence:
            raise CommitRejected(f"fence {fence} is not after {self._last_fence}")
        reason = self.blocking_reason(plan)
        if reason is not None:
            raise WindowNotReady(reason)
        if len(plan.lanes) > min(plan.shape.batch_capacity, MAX_REQUEST_SLOTS):
            raise CommitRejected("plan exceeds the shape's request capacity")
        for lane in plan.lanes:
            self._check_lane(lane)
        for lane in plan.lanes:
            req = self._requests[lane.handle]
            req.in_flight.append(fence)
            if lane.role is LaneRole.DECODE:
                req.queued_outputs += lane.token_ceiling
        self._estimates.record_attempt(plan.shape, self._now_ns)
        self._frames.append((fence, plan))
        self._last_fence = fence
        self._committed += 1
        self._last_step_had_prompt = any(lane.role is LaneRole.PROMPT for lane in plan.lanes)
        trace = TraceRecord(
            fence=fence, shape=plan.shape, lanes=len(plan.lanes),
            selected_cost_ns=plan.estimated_duration_ns,
            observation_age_ns=self._estimates.observation_age_ns(plan.shape, self._now_ns),
            reason=plan.reason, exploration_credit_ns=0.0,
            value_rate=plan.selection_value_rate(), log_scale=0.0,
            committed_at_ns=self._now_ns,
        )
        self._traces.append(trace)
        return trace

    def _check_lane(self, lane: Lane) -> None:
        req = self._requests.get(lane.handle)
        if req is None or req.epoch != lane.epoch or req.cancelled:
            raise StaleEpochError(f"request {lane.handle} epoch {lane.epoch} is not live")
        if lane.role is LaneRole.PROMPT:
            ok = (req.phase is Phase.PREFILL and not req.in_flight
                  and req.prompt_cursor == lane.prompt_start
                  and 0 < lane.prompt_tokens <= req.chunk_limit())
        elif lane.role is LaneRole.DECODE:
            ok = req.phase is Phase.DECODE and req.output_room >= lane.token_ceiling
        else:
            ok = req.phase is Phase.TERMINAL and not req.in_flight
        if not ok:
            raise StalePlanError(f"request {lane.handle} changed since planning")

    # ---- completion --------------------------------------------------------------------

    def complete(self, fence: Fence, records: Sequence[CompletionRecord],
                 timing: ExecutionTiming) -> list[GeneratedToken]:
        """Apply the oldest frame's results; malformed lanes fail only their request."""
        if not self._frames or self._frames[0][0] != fence:
            raise CompletionError(f"fence {fence} is not the oldest frame in flight")
        plan = self._frames[0][1]
        by_handle: dict[RequestHandle, CompletionRecord] = {}
        duplicates: set[RequestHandle] = set()
        for r in records:
            if r.handle in by_handle:
                duplicates.add(r.handle)
            by_handle[r.handle] = r
        verdicts = [(lane, _valid(lane, by_handle.get(lane.handle), duplicates))
                    for lane in plan.lanes]
        # ---- nothing has changed before this point ----
        self._frames.popleft()
        self._executions[SelectionReason.ORDINARY.value] += 1
        self._execution_ns[SelectionReason.ORDINARY.value] += max(timing.device_ns, 0)
        self._estimates.observe(plan.shape, timing.cost_sample_ns, self._now_ns)
        out: list[GeneratedToken] = []
        for lane, ok in verdicts:
            req = self._requests.get(lane.handle)
            if req is None or req.epoch != lane.epoch:
                continue
            req.in_flight.remove(fence)
            if lane.role is LaneRole.DECODE:
                req.queued_outputs -= lane.token_ceiling
            if req.cancelled or req.failed:
                continue
            if not ok:
                self._failed_lanes += 1
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
        first = False
        if lane.role is LaneRole.PROMPT:
            req.prompt_cursor += lane.prompt_tokens
            self._on_served(req, lane.prompt_tokens, len(record.token_ids))
            if req.prompt_cursor < req.prompt_len:
                return None
            req.phase = Phase.DECODE
            first = True
        else:
            self._on_served(req, 0, len(record.token_ids))
        req.output_committed += len(record.token_ids)
        finish: FinishKind | None = None
        if record.terminated:
            finish = FinishKind.STOP
        elif req.output_committed >= req.max_output_tokens:
            finish = FinishKind.LENGTH
        if finish is not None:
            self._retire(req)
        return GeneratedToken(handle=req.handle, epoch=req.epoch, fence=fence,
                              token_ids=record.token_ids, first=first, finish=finish)

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

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            executions=dict(self._executions), execution_ns=dict(self._execution_ns),
            resident=len(self._requests), in_flight=len(self._frames),
            refresh_credit_ns=0.0, committed_plans=self._committed,
            failed_lanes=self._failed_lanes,
        )

    def traces(self) -> tuple[TraceRecord, ...]:
        return tuple(self._traces)

    def in_flight(self) -> tuple[Fence, ...]:
        return tuple(f for f, _ in self._frames)

    def _request(self, handle: RequestHandle) -> BaselineRequest:
        req = self._requests.get(handle)
        if req is None:
            raise UnknownRequestError(f"request {handle} is not resident")
        return req


def _valid(lane: Lane, record: CompletionRecord | None,
           duplicates: set[RequestHandle]) -> bool:
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
