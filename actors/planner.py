"""planner: the thin loop around the scheduling policy (architecture step 3).

On every event the planner advances the scheduler's clock, applies the event, then
plans and submits while a plan fits the window: it reserves pages with the
checkpoint-allocator *before* ``commit`` (QUEUE-49), packs the frame
(``frame_inputs``) and sends it to the dispatcher. The scheduler's frame queue holds
at most two frames and decides which plans may queue behind another and when the
window must drain (QUEUE-10..14, QUEUE-34..39); the planner never second-guesses it.

Completion and publication order (ACCT-17): after ``complete(fence N)`` the planner
sends the frame's tokens to the publisher and handles no further completion until the
publisher's ``Published(N)`` arrived, so the delivery correction never rewinds across
later service observations. When that completion left the device idle (the window
drained, QUEUE-12), the planner first plans and launches the next frame and only then
sends the tokens, so the device does not wait for publication. Resources of requests
the scheduler releases are returned (``Release``) *before* their last tokens go to the
publisher, so a client that sees ``Finished`` and sends its next turn finds the
terminal checkpoint published (PRE-53).
A request whose output ended but cannot be released yet (a terminal capture to run,
or a decode queued behind its final token) gets ``Finished`` right after its last
tokens; the allocator, told first (``Finishing``), holds its conversation's next turn
until the release published the checkpoint (PRE-53; docs/runtime.md, *Checkpoints*).
Cancellation stops selection at once (``Scheduler.cancel``); the client stream ends
right away, while pages and row stay owned through the request's last fence.
The planner drives its policy only through ``policy.protocol.SchedulingPolicy``: a
speculative frame completes with its round report (``RoundCompletion``); what the
policy learns from it is its own business. For a policy that learns acceptance the
planner also replays the rounds no frame ran and reports the decided ones after each
completion (``actors.acceptance_observations``). With ``decode_prompt_tail`` a request
whose uncached prompt is one token is admitted decoding (``decodes_last_token``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
import trio

from actors.acceptance_observations import AcceptanceObservations, count_round, round_completion
from actors.copy_counterfactuals import CopyCounterfactuals
from actors.frame_inputs import (
    LaneSource,
    admitted_source,
    decodes_last_token,
    lane_extent,
    mark_submitted,
    pack_frame,
    settle_decodes,
    settled,
)
from actors.grammar import GrammarVocabulary, request_matcher
from actors.image_content import ImageWindowing, image_plan
from actors.messages import (
    AdmissionClosed,
    Admitted,
    AllocatorInbox,
    Cancel,
    DispatcherInbox,
    Drop,
    Finishing,
    FrameOrder,
    LaneExtent,
    PagePlan,
    PlannerInbox,
    PromptScoreRecord,
    Published,
    PublisherInbox,
    PublishFrame,
    Release,
    RequestId,
    Reserve,
    SnapshotPlan,
    Track,
    ValidatedFrame,
)
from actors.planner_records import FRAME_LOG_LENGTH, FrameRecord, PlannerCounters, log_trace
from actors.public import Alternatives, FinishReason
from actors.reported_logprobs import kept_alternatives, scheduled_output_tokens, token_logprobs
from actors.window_epochs import renew_window_epochs
from policy import (
    FRAME_SLOTS,
    CommitRejected,
    Fence,
    FinishKind,
    GeneratedToken,
    Lane,
    LaneRole,
    Phase,
    RequestHandle,
    SchedulingPolicy,
)

log = structlog.get_logger("flare.planner")


@dataclass(slots=True, kw_only=True)
class _Resident:
    request_id: RequestId
    source: LaneSource
    kv_done: int
    """KV positions written by validated, applied frames (what may be published)."""
    scores: list[float]
    score_tops: list[Alternatives] = field(default_factory=list)
    host_finish: FinishReason | None = None
    """How the output ended (scheduler finish or host stop); ``Drop`` carries it."""
    cancelled: bool = False
    failed: bool = False
    snapshot_done: bool = False
    """Its terminal snapshot frame completed and validated (PRE-39)."""
    finish_sent: bool = False
    """Its ``Drop`` (the client's ``Finished``) went out before its release."""
    counterfactuals: CopyCounterfactuals | None = None
    """Its counterfactual copy rounds (adaptive copy speculation only)."""
    scheduled_ns: int | None = None
    """When its first frame was submitted (its queue time ends; ``Drop`` carries it)."""


class Planner:
    """The planner's state; ``run`` feeds it events. Methods that send are async."""

    def __init__(
        self,
        scheduler: SchedulingPolicy,
        *,
        to_dispatcher: trio.MemorySendChannel[DispatcherInbox],
        to_publisher: trio.MemorySendChannel[PublisherInbox],
        to_allocator: trio.MemorySendChannel[AllocatorInbox],
        eos_token_ids: Sequence[int],
        clock_ns: Callable[[], int],
        counterfactual_depth: int = 0,
        learned_counterfactuals: bool = False,
        grammar: GrammarVocabulary | None = None, grammar_resident: bool = False,
        image_windowing: ImageWindowing | None = None, decode_prompt_tail: bool = False,
    ) -> None:
        """``counterfactual_depth``: drafts per counterfactual copy round (0: none are
        kept). ``learned_counterfactuals``: fold the learned draft's depth-one proposals
        of width-one steps into the scheduler (``actors.acceptance_observations``).
        ``grammar``: the vocabulary constrained requests' matchers run on (admission
        refuses them without one); ``grammar_resident``: the programs hold their grammars
        (no feedback needed); ``image_windowing``: how image prompts are planned."""
        self.scheduler = scheduler
        self._image_windowing = image_windowing or ImageWindowing()
        self._to_dispatcher = to_dispatcher
        self._to_publisher = to_publisher
        self._to_allocator = to_allocator
        self._eos = tuple(eos_token_ids)
        self._grammar = grammar
        self._grammar_resident = grammar_resident
        self._decode_prompt_tail = decode_prompt_tail
        self._clock_ns = clock_ns
        self._residents: dict[RequestHandle, _Resident] = {}
        self._by_request: dict[RequestId, RequestHandle] = {}
        self._next_fence = 1
        self._awaiting: Fence | None = None
        self._awaiting_handles: tuple[RequestHandle, ...] = ()
        self._deferred: deque[ValidatedFrame] = deque()
        self._drops: deque[Drop] = deque()
        self._held_publication: PublishFrame | None = None
        """A completed frame's tokens held back while the next frame is planned and
        launched onto an idle device (``_send_held_publication``)."""
        self.draining = False
        self.counters = PlannerCounters()
        self._observations = AcceptanceObservations(
            scheduler, self.counters, counterfactual_depth=counterfactual_depth,
            learned_counterfactuals=learned_counterfactuals)
        self.executions_by_graph: dict[str, int] = {}
        self.frame_log: deque[FrameRecord] = deque(maxlen=FRAME_LOG_LENGTH)

    # ------------------------------------------------------------------ state views

    @property
    def resident_count(self) -> int:
        return len(self._residents)

    @property
    def idle(self) -> bool:
        return (not self._residents and not self.scheduler.in_flight()
                and self._awaiting is None and not self._deferred)

    def _now(self) -> int:
        now = max(self._clock_ns(), self.scheduler.now_ns)
        self.scheduler.advance_to(now)
        return now

    # ------------------------------------------------------------------ events

    async def handle(self, msg: PlannerInbox) -> None:
        self._now()
        if isinstance(msg, Admitted):
            await self._admit(msg)
        elif isinstance(msg, Cancel):
            await self._cancel(msg.request_id)
        elif isinstance(msg, AdmissionClosed):
            self.draining = True
            for request_id in list(self._by_request):
                await self._cancel(request_id, message="the runtime shut down")
        elif isinstance(msg, ValidatedFrame):
            self._deferred.append(msg)
        else:
            await self._published(msg)
        while self._awaiting is None and self._deferred:
            await self._complete(self._deferred.popleft())
        await self._release_finished()
        if self._held_publication is None:
            await self._send_drops()
        await self._plan_and_submit()
        await self._send_held_publication()  # nothing was launched

    async def _admit(self, msg: Admitted) -> None:
        request, grant = msg.request, msg.grant
        images = image_plan(request.images, self._image_windowing)
        tail = self._decode_prompt_tail and decodes_last_token(request, grant.cached_tokens)
        handle = self.scheduler.admit(
            prompt_len=len(request.prompt_token_ids), max_output_tokens=scheduled_output_tokens(request),
            cached_prefix_len=grant.cached_tokens, message_ends=request.message_ends,
            system_end=request.system_end, scored_prompt=request.prompt_logprobs,
            handle=grant.handle, grammar_constrained=request.grammar is not None, images=images,
            grammar_resident=self._grammar_resident and request.grammar is not None,
            decode_prompt_tail=tail, arrived_ns=msg.arrived_ns)
        self.scheduler.assign_client(handle, request.client)
        epoch = self.scheduler.request(handle).epoch
        source = admitted_source(
            request, grant, epoch=epoch, eos_token_ids=self._eos,
            grammar=request_matcher(self._grammar, request.grammar),
            image_plan=images, grammar_resident=self._grammar_resident, decodes_prompt_tail=tail)
        self._residents[handle] = _Resident(request_id=msg.request_id, source=source, scores=[],
                                            kv_done=grant.cached_tokens)
        self._by_request[msg.request_id] = handle
        self.counters.prefix_hit_tokens += grant.cached_tokens
        if not request.prompt_logprobs:  # scored prompts skip the cache lookup (admission)
            self.counters.prefix_query_tokens += len(request.prompt_token_ids)
        await self._to_publisher.send(Track(
            request_id=msg.request_id, handle=handle, epoch=epoch, request=request,
            cached_tokens=grant.cached_tokens, events=msg.events, arrived_ns=msg.arrived_ns,
        ))

    async def _cancel(self, request_id: RequestId, message: str = "") -> None:
        handle = self._by_request.get(request_id)
        resident = self._residents.get(handle) if handle is not None else None
        if handle is None or resident is None or resident.cancelled:
            return
        resident.cancelled = True
        self.scheduler.cancel(handle)
        await self._to_publisher.send(Drop(handle=handle, epoch=resident.source.epoch,
                                           reason="cancelled", message=message,
                                           scheduled_ns=resident.scheduled_ns))

    def _complete_in_scheduler(self, frame: ValidatedFrame) -> list[GeneratedToken]:
        """``complete`` with what a speculative frame's lanes report (QUEUE-3, QUEUE-4,
        ACC-28): the policy decides what it learns from them."""
        rounds = frame.rounds
        if rounds is None:
            return self.scheduler.complete(frame.fence, frame.records, frame.timing)
        count_round(self.counters, rounds)  # any policy's rounds (fixed-spec-K included)
        return self.scheduler.complete(frame.fence, frame.records, frame.timing,
                                       round=round_completion(rounds))

    async def _complete(self, frame: ValidatedFrame) -> None:
        tokens = self._complete_in_scheduler(frame)
        self._observations.completed(frame, tokens, self._residents)
        self.counters.frames += 1
        label = frame.plan.shape.label()
        self.executions_by_graph[label] = self.executions_by_graph.get(label, 0) + 1
        self.frame_log.append(FrameRecord(
            fence=frame.fence, graph=label, lanes=len(frame.plan.lanes),
            launched_ns=frame.launched_ns, observed_ns=frame.observed_ns,
            device_ns=frame.timing.device_ns))
        self._apply_extents(frame)
        for failure in frame.failures:
            resident = self._residents.get(failure.handle)
            if resident is not None and resident.source.epoch == failure.epoch:
                resident.failed = True
                log.warning("lane failed", handle=failure.handle, reason=failure.message)
        logprobs, top_logprobs = token_logprobs(frame, tokens, self._top_logprobs_of)
        scores = self._prompt_scores(frame)
        for token in tokens:
            resident = self._residents.get(token.handle)
            if resident is None or resident.source.epoch != token.epoch:
                continue
            resident.source.output_ids.extend(token.token_ids)
            self.counters.generation_tokens += len(token.token_ids)
            if token.finish is not None:
                resident.failed = resident.failed or token.finish is FinishKind.ERROR
                if resident.host_finish is None and token.finish is not FinishKind.ERROR:
                    resident.host_finish = (
                        "length" if token.finish is FinishKind.LENGTH else "stop")
        # Release before the stream can end (PRE-53); Drop after the last tokens.
        await self._release_finished()
        await self._finish_before_capture(tokens)
        if tokens or frame.failures or scores:
            self._awaiting = frame.fence
            self._awaiting_handles = tuple(t.handle for t in tokens if t.token_ids)
            publication = PublishFrame(
                fence=frame.fence, tokens=tuple(tokens), logprobs=logprobs,
                errors=frame.failures, prompt_scores=scores, top_logprobs=top_logprobs,
            )
            if not self.scheduler.in_flight():
                # The device is idle (the window drained, QUEUE-12): plan and launch
                # the next frame first, then publish (``_send_held_publication``). With
                # a frame still running, publishing first costs the device nothing.
                self._held_publication = publication
                return
            await self._to_publisher.send(publication)
        await self._send_drops()

    def _apply_extents(self, frame: ValidatedFrame) -> None:
        for lane, record in zip(frame.plan.lanes, frame.records, strict=True):
            resident = self._residents.get(lane.handle)
            if resident is None or not settled(lane, resident.source, ok=record.ok):
                continue
            if lane.role is LaneRole.PROMPT:
                resident.kv_done = lane.prompt_start + lane.prompt_tokens
                self.counters.prompt_tokens += lane.prompt_tokens
            elif lane.role is LaneRole.DECODE:
                # A round writes KV for the tokens it fed: the pending token and the
                # accepted drafts, one per emitted token (ordinary decode: one).
                emitted = len(record.token_ids)
                resident.kv_done += emitted
                settle_decodes(lane, resident.source, emitted)
            elif lane.role is LaneRole.TERMINAL:
                resident.snapshot_done = True

    def _top_logprobs_of(self, handle: RequestHandle) -> int:
        resident = self._residents.get(handle)
        return resident.source.request.top_logprobs if resident is not None else 0

    def _prompt_scores(self, frame: ValidatedFrame) -> tuple[PromptScoreRecord, ...]:
        if frame.prompt_logprobs is None:
            return ()
        out = []
        for lane, record in zip(frame.plan.lanes, frame.records, strict=True):
            resident = self._residents.get(lane.handle)
            if resident is None or lane.role is not LaneRole.PROMPT or not record.ok:
                continue
            resident.scores.extend(frame.prompt_logprobs[:lane.prompt_tokens])
            resident.score_tops.extend(kept_alternatives(
                (frame.prompt_top_logprobs or ())[:lane.prompt_tokens],
                resident.source.request.top_logprobs))
            if lane.prompt_start + lane.prompt_tokens == len(resident.source.prompt):
                out.append(PromptScoreRecord(handle=lane.handle, logprobs=tuple(resident.scores),
                                             top_logprobs=tuple(resident.score_tops)))
        return tuple(out)

    async def _published(self, msg: Published) -> None:
        if msg.fence != self._awaiting:
            # Only one PublishFrame is ever outstanding; anything else is a bug that
            # must stop the system loudly rather than stall completions forever.
            raise RuntimeError(f"publication for fence {msg.fence}, awaiting {self._awaiting}")
        visible = dict(msg.visible)
        for handle in self._awaiting_handles:
            if handle in visible:
                self.scheduler.published_output(handle, msg.fence, visible[handle])
            else:
                self.scheduler.nothing_published(handle, msg.fence)
        self._awaiting = None
        self._awaiting_handles = ()
        for finish in msg.finished:
            resident = self._residents.get(finish.handle)
            if resident is None or resident.source.epoch != finish.epoch:
                continue
            resident.host_finish = finish.reason
            if not resident.cancelled:
                resident.cancelled = True
                self.scheduler.cancel(finish.handle)

    async def _finish_before_capture(self, tokens: Sequence[GeneratedToken]) -> None:
        """Requests whose output ended normally but that are not released yet because
        a frame is still in flight for them (a decode queued behind the final token):
        their streams end now, after these tokens, and the allocator holds their
        continuations until the release (PRE-53). A request with a terminal capture
        pending keeps the seed's order instead: its visible completion waits for the
        snapshot (PRE-38)."""
        for token in tokens:
            resident = self._residents.get(token.handle)
            if (token.finish is None or token.finish is FinishKind.ERROR or resident is None
                    or resident.source.epoch != token.epoch or resident.finish_sent
                    or resident.host_finish is None
                    or self.scheduler.phase(token.handle) is Phase.TERMINAL):
                continue
            source = resident.source
            written = source.written_content(resident.kv_done)
            await self._to_allocator.send(Finishing(handle=token.handle, token_ids=written,
                                                    kv_tokens=len(written)))
            resident.finish_sent = True
            self._drops.append(Drop(handle=token.handle, epoch=source.epoch,
                                    reason=resident.host_finish,
                                    scheduled_ns=resident.scheduled_ns))

    async def _release_finished(self) -> None:
        for handle in self.scheduler.take_released():
            resident = self._residents.pop(handle, None)
            if resident is None:
                continue
            self._by_request.pop(resident.request_id, None)
            source = resident.source
            written = source.written_content(resident.kv_done)
            await self._to_allocator.send(Release(
                handle=handle, token_ids=written, kv_tokens=len(written),
                publish=not resident.failed, snapshot_done=resident.snapshot_done,
            ))
            if resident.host_finish is not None and not resident.finish_sent:
                self._drops.append(Drop(handle=handle, epoch=source.epoch,
                                        reason=resident.host_finish,
                                        scheduled_ns=resident.scheduled_ns))

    async def _send_drops(self) -> None:
        """End finished streams; called after the frame's tokens went to the publisher
        (the same channel, so the last tokens precede ``Finished``)."""
        while self._drops:
            await self._to_publisher.send(self._drops.popleft())

    # ------------------------------------------------------------------ planning

    async def _reserve(self, fence: Fence, extents: tuple[LaneExtent, ...]
                       ) -> tuple[PagePlan | SnapshotPlan, ...]:
        send, receive = trio.open_memory_channel[tuple[PagePlan | SnapshotPlan, ...]](1)
        async with receive:
            await self._to_allocator.send(Reserve(fence=fence, extents=extents, reply=send))
            return await receive.receive()

    def _window_open(self) -> bool:
        """Whether planning can lead to a submission now. Planning costs host time that
        the device's next frame waits for (on the cpu backend it also holds the GIL the
        worker needs), so the planner does not plan while nothing could be submitted:
        both slots full (QUEUE-10), or the scheduler says its window takes nothing more
        (``window_open``: an overrun, QUEUE-39, or a tail nothing may queue behind,
        QUEUE-11, QUEUE-12)."""
        return len(self.scheduler.in_flight()) < FRAME_SLOTS and self.scheduler.window_open()

    async def _plan_and_submit(self) -> None:
        while True:
            now = self._now()
            if not self._window_open():
                return
            plan = self.scheduler.plan()
            if plan is None or not self.scheduler.window_ready(plan):
                return
            fence = Fence(self._next_fence)
            sources = {h: r.source for h, r in self._residents.items()}
            plan = await renew_window_epochs(plan, sources, self.scheduler, self._to_publisher)
            extents = tuple(self._extent(lane, sources) for lane in plan.lanes)
            plans = await self._reserve(fence, extents)
            pages = [p for p in plans if isinstance(p, PagePlan)]
            snapshots = [p for p in plans if isinstance(p, SnapshotPlan)]
            frame, contexts = pack_frame(plan, sources, pages, snapshots)
            # The clock stays at the planning instant: the reservation round trip is
            # part of this planning step, not time in which the window can overrun.
            try:
                trace = self.scheduler.commit(plan, fence)
            except CommitRejected as exc:
                # Nothing changed; the reserved pages stay with their requests and the
                # fence number is reused by the next commit, which retires the pin.
                log.info("plan rejected at commit; replanning later", reason=str(exc))
                return
            self._next_fence += 1
            self.counters.window_snapshots += mark_submitted(plan, sources)
            for lane in plan.lanes:
                resident = self._residents[lane.handle]
                if resident.scheduled_ns is None:
                    resident.scheduled_ns = now
            log_trace(trace)
            await self._to_dispatcher.send(FrameOrder(fence=fence, plan=plan, frame=frame,
                                                      lanes=contexts))
            await self._send_held_publication()  # the device is busy again

    async def _send_held_publication(self) -> None:
        """Send the tokens held back while the idle device got its next frame, and the
        drops that wait for them (``_complete``)."""
        if self._held_publication is not None:
            publication, self._held_publication = self._held_publication, None
            await self._to_publisher.send(publication)
            await self._send_drops()


    def _extent(self, lane: Lane, sources: dict[RequestHandle, LaneSource]) -> LaneExtent:
        if lane.role is LaneRole.TERMINAL:
            # The snapshot copies what validated frames wrote (PRE-38).
            return LaneExtent(handle=lane.handle, kv_tokens=self._residents[lane.handle].kv_done,
                              snapshot=True)
        return lane_extent(lane, sources[lane.handle])


async def run(
    inbox: trio.MemoryReceiveChannel[PlannerInbox],
    planner: Planner,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve events until admission has closed and every request and frame is done;
    then close the dispatcher, publisher and allocator ends (orderly stop spreads)."""
    async with inbox, planner._to_dispatcher, planner._to_publisher, planner._to_allocator:
        task_status.started()
        async for msg in inbox:
            await planner.handle(msg)
            if planner.draining and planner.idle:
                break
