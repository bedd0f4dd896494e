"""admission: validates requests, keeps the bounded admission queue, and makes requests
resident once the checkpoint-allocator grants them a row and a page budget.

Architecture step 2. ``check_request`` is the pure decision (limits in
``AdmissionLimits``); ``AdmissionState`` is the queue logic; ``run`` is the actor.

- Refusals are typed (``actors.errors``) and answered on the caller's decision
  channel before ``generate`` yields anything: ``InvalidRequest`` (never servable as
  sent), ``ContextTooLong`` (prompt plus ``max_tokens`` beyond the context),
  ``QueueFull`` with a retry hint (``max_queue`` requests already wait),
  ``RuntimeShutDown``.
- Backpressure is explicit: at most ``max_queue`` accepted requests wait; only the
  queue head is parked at the allocator, so a request withdrawn while queued never
  touches a resource. The queue is FIFO, or with ``prefill_ns`` (``--admission-order
  least-slack``, ``policy.admission_order``) sorted by arrival minus the prompt's pure
  prefill time. A request that goes before the head already parked at the allocator
  cancels the head's ``Acquire``: refused, the head returns to its place in the queue;
  granted first, it is admitted anyway. A request of a ``prefill_group``
  whose prompt another member is still prefilling waits parked at the head until that
  member's prompt pages are published (a frame or two), so it reuses them.
- A granted request goes to the planner with its client stream (``Admitted``); a
  withdrawal of a resident request is forwarded as ``Cancel``.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import trio

from actors.errors import (
    AdmissionError,
    ContextTooLong,
    InvalidRequest,
    QueueFull,
    RuntimeShutDown,
)
from actors.grammar import GrammarVocabulary
from actors.image_content import content_ids
from actors.messages import (
    Acquire,
    AdmissionClosed,
    AdmissionInbox,
    Admit,
    Admitted,
    AllocatorInbox,
    Cancel,
    CancelAcquire,
    CloseAdmission,
    Grant,
    GrantArrived,
    PlannerInbox,
    Release,
    RequestId,
    Withdraw,
)
from actors.public import TOP_LOGPROBS, Finished, GenerationRequest
from actors.reported_logprobs import scheduled_output_tokens
from actors.window_snapshots import needs_snapshot_row
from policy import DEFAULT_WINDOW_IMAGES, fits_context, least_slack_key

log = structlog.get_logger("flare.admission")

MAX_STOP_STRINGS = 16
"""More stop strings than this is almost certainly a client bug (OpenAI allows 4)."""

QUEUE_FULL_RETRY_AFTER_S = 1
"""Retry hint for ``QueueFull``: about one scheduling round of a busy server."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionLimits:
    max_context: int
    vocab_size: int
    max_queue: int
    prefix_caching: bool = True
    """False: no request reuses cached prefix pages (``--no-enable-prefix-caching``)."""
    grammar: GrammarVocabulary | None = None
    """The vocabulary grammar-constrained requests run on (None: they are refused)."""
    structured_output: str = ""
    """Why grammar-constrained requests cannot run here ("" when they can)."""
    window_images: int = DEFAULT_WINDOW_IMAGES
    """Images one window holds: a prompt with more needs a private snapshot row."""
    decode_prompt_tail: bool = False
    """``RuntimeConfig.decode_prompt_tail``: a prompt found whole in the cache gets a copy
    of its last page, so that one token is left for its first decode step."""


def _end(msg: Admit, message: str) -> None:
    """End an accepted, never-started request's stream."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        msg.events.send_nowait(Finished(
            reason="cancelled", prompt_tokens=len(msg.request.prompt_token_ids),
            completion_tokens=0, message=message,
        ))
    msg.events.close()


def check_request(request: GenerationRequest, limits: AdmissionLimits) -> AdmissionError | None:
    """The first reason ``request`` can never be served, or None."""
    prompt = request.prompt_token_ids
    if not prompt:
        return InvalidRequest("the prompt is empty")
    if request.max_tokens < (0 if request.prompt_logprobs else 1):
        return InvalidRequest(f"max_tokens must be at least 1 (0 only when scoring the "
                              f"prompt), got {request.max_tokens}")
    if not 0 <= request.top_logprobs <= TOP_LOGPROBS:
        return InvalidRequest(f"top_logprobs must lie in 0..{TOP_LOGPROBS}, "
                              f"got {request.top_logprobs}")
    if any(not 0 <= t < limits.vocab_size for t in prompt):
        return InvalidRequest(f"prompt token ids must lie in 0..{limits.vocab_size - 1}")
    if not fits_context(prompt_len=len(prompt), max_tokens=scheduled_output_tokens(request),
                        limit=limits.max_context):
        return ContextTooLong(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({request.max_tokens}) exceeds "
            f"the model's context of {limits.max_context} tokens"
        )
    sampling_problem = (request.sampling.problem()
                        or request.sampling.token_problem(limits.vocab_size))
    if sampling_problem is not None:
        return InvalidRequest(sampling_problem)
    if request.sampling.min_tokens > request.max_tokens:
        return InvalidRequest(f"min_tokens ({request.sampling.min_tokens}) exceeds max_tokens "
                              f"({request.max_tokens})")
    if len(request.stop) > MAX_STOP_STRINGS:
        return InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not 0 < e <= len(prompt) for e in request.message_ends):
        return InvalidRequest("message_ends must lie within the prompt")
    if request.system_end is not None and not 0 < request.system_end <= len(prompt):
        return InvalidRequest("system_end must lie within the prompt")
    if request.grammar is not None:
        problem = limits.structured_output or (
            limits.grammar.problem(request.grammar) if limits.grammar is not None
            else "structured output is not available on this runtime")
        if problem:
            return InvalidRequest(f"grammar: {problem}")
    return None


class AdmissionState:
    """The admission queue. Methods return the messages to send; ``run`` sends them."""

    def __init__(self, limits: AdmissionLimits,
                 prefill_ns: Callable[[int], float | None] | None = None) -> None:
        """``prefill_ns``: the least-slack order's pure prefill time of a prompt of that
        many tokens (None when no estimate is known yet); None: FIFO."""
        self.limits = limits
        self.prefill_ns = prefill_ns
        self.waiting: deque[Admit] = deque()
        self._keys: dict[RequestId, float] = {}
        self._cancel_due: RequestId | None = None
        self.reordered = 0
        """Requests queued ahead of an earlier arrival (least slack)."""
        self.head_parked = False
        self.head_withdrawn = False
        self.head_displaced = False
        """The parked head's ``Acquire`` is being cancelled for a request that goes
        before it; a refusal puts it back in the queue, a grant admits it anyway."""
        self.closing = False

    def on_admit(self, msg: Admit) -> AdmissionError | None:
        if self.closing:
            return RuntimeShutDown("the runtime is shutting down")
        refusal = check_request(msg.request, self.limits)
        if refusal is None and len(self.waiting) >= self.limits.max_queue:
            refusal = QueueFull(
                f"{len(self.waiting)} requests are already waiting; try again shortly",
                retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
            )
        if refusal is None and self._enqueue(msg):
            self.reordered += 1
        return refusal

    def _enqueue(self, msg: Admit) -> bool:
        """Queue ``msg`` in order; True if it went ahead of a request already waiting."""
        arrived = msg.arrived_ns
        prefill = None if self.prefill_ns is None or arrived is None \
            else self.prefill_ns(len(msg.request.prompt_token_ids))
        if prefill is None or arrived is None:
            self.waiting.append(msg)
            return False
        key = self._keys[msg.request_id] = least_slack_key(arrived, prefill)
        index = len(self.waiting)
        first = 1 if self.head_parked else 0
        ahead = self.head_parked and not (self.head_withdrawn or self.head_displaced) \
            and key < self._keys.get(self.waiting[0].request_id, -math.inf)
        if ahead:
            self.head_displaced = True
            self._cancel_due = self.waiting[0].request_id
        while index > first and self._keys.get(self.waiting[index - 1].request_id,
                                                -math.inf) > key:
            index -= 1
        self.waiting.insert(index, msg)
        return ahead or index < len(self.waiting) - 1

    def take_displaced(self) -> RequestId | None:
        """The parked head whose ``Acquire`` to cancel, once, because a request that
        arrived since goes before it (least slack); None otherwise."""
        displaced, self._cancel_due = self._cancel_due, None
        return displaced

    def acquire_for_head(self, reply: trio.MemorySendChannel[Grant | None]) -> Acquire | None:
        """The ``Acquire`` to park for the queue head, if one is due."""
        if self.head_parked or not self.waiting:
            return None
        head = self.waiting[0]
        self.head_parked = True
        self.head_withdrawn = False
        return Acquire(
            request_id=head.request_id,
            prompt_token_ids=content_ids(head.request.prompt_token_ids, head.request.images),
            max_tokens=scheduled_output_tokens(head.request),
            message_ends=head.request.message_ends,
            use_prefix_cache=self.limits.prefix_caching and not head.request.prompt_logprobs,
            reply=reply, prompt_group=head.request.prefill_group,
            window_snapshots=needs_snapshot_row(head.request.images, self.limits.window_images),
            copy_last_page=self.limits.decode_prompt_tail and not head.request.images,
        )

    def on_withdraw(self, request_id: RequestId) -> str:
        """'parked' (cancel the allocator request), 'queued' (dropped here), or
        'resident' (forward to the planner)."""
        for index, msg in enumerate(self.waiting):
            if msg.request_id != request_id:
                continue
            if index == 0 and self.head_parked:
                self.head_withdrawn = True
                return "parked"
            del self.waiting[index]
            self._keys.pop(request_id, None)
            msg.events.close()
            return "queued"
        return "resident"

    def close(self) -> tuple[RequestId, ...]:
        """Admit nothing more; end every queued request. Returns the parked head's id
        (to withdraw at the allocator), if any."""
        self.closing = True
        parked = self.waiting.popleft() if self.head_parked and self.waiting else None
        for msg in self.waiting:
            _end(msg, "the runtime shut down before this request started")
        self.waiting.clear()
        self._keys.clear()
        if parked is None:
            return ()
        self.waiting.append(parked)
        self.head_withdrawn = True
        return (parked.request_id,)

    def on_grant(self, grant: Grant | None) -> tuple[Admit | None, Grant | None]:
        """The head's answer: (admit to the planner, grant to give back)."""
        head = self.waiting.popleft()
        self.head_parked = False
        displaced, self.head_displaced = self.head_displaced, False
        if grant is None and displaced and not self.head_withdrawn:
            self._enqueue(head)  # after the request that displaced it
            return None, None
        self._keys.pop(head.request_id, None)
        if grant is None or self.head_withdrawn:
            if self.closing:
                _end(head, "the runtime shut down before this request started")
            else:
                head.events.close()  # the client withdrew; nobody reads the stream
            return None, grant
        return head, grant


async def _await_grant(
    receive: trio.MemoryReceiveChannel[Grant | None],
    loopback: trio.MemorySendChannel[AdmissionInbox],
    request_id: RequestId,
) -> None:
    async with receive, loopback:
        try:
            grant = await receive.receive()
        except trio.EndOfChannel:
            grant = None
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await loopback.send(GrantArrived(request_id=request_id, grant=grant))


async def run(
    inbox: trio.MemoryReceiveChannel[AdmissionInbox],
    loopback: trio.MemorySendChannel[AdmissionInbox],
    to_allocator: trio.MemorySendChannel[AllocatorInbox],
    to_planner: trio.MemorySendChannel[PlannerInbox],
    *,
    state: AdmissionState,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Admit until ``CloseAdmission`` arrives and the parked head is settled.

    ``loopback`` is admission's own end of its inbox, cloned for the tasks that wait
    on the allocator's answers.
    """
    async with trio.open_nursery() as nursery, to_allocator, to_planner:
        task_status.started()

        async def park_head() -> None:
            reply_send, reply_receive = trio.open_memory_channel[Grant | None](1)
            acquire = state.acquire_for_head(reply_send)
            if acquire is None:
                reply_send.close()
                reply_receive.close()
                return
            nursery.start_soon(_await_grant, reply_receive, loopback.clone(), acquire.request_id)
            await to_allocator.send(acquire)

        async with inbox:
            with loopback:
                async for msg in inbox:
                    if isinstance(msg, Admit):
                        queued = _decide(state, msg)
                        displaced = state.take_displaced()
                        if displaced is not None:
                            log.debug("admission.reordered", request_id=msg.request_id,
                                      displaced=displaced)
                            await to_allocator.send(CancelAcquire(request_id=displaced))
                        if not queued:
                            continue
                        await park_head()
                    elif isinstance(msg, Withdraw):
                        where = state.on_withdraw(msg.request_id)
                        if where == "parked":
                            await to_allocator.send(CancelAcquire(request_id=msg.request_id))
                        elif where == "resident":
                            await to_planner.send(Cancel(request_id=msg.request_id))
                    elif isinstance(msg, CloseAdmission):
                        for parked in state.close():
                            await to_allocator.send(CancelAcquire(request_id=parked))
                    else:
                        admit, grant = state.on_grant(msg.grant)
                        if admit is not None and grant is not None:
                            await to_planner.send(Admitted(
                                request_id=admit.request_id, request=admit.request,
                                grant=grant, events=admit.events,
                                arrived_ns=admit.arrived_ns,
                            ))
                        elif grant is not None:
                            await to_allocator.send(Release(handle=grant.handle))
                        await park_head()
                    if state.closing and not state.waiting:
                        break
            await to_planner.send(AdmissionClosed())


def _decide(state: AdmissionState, msg: Admit) -> bool:
    """Answer an ``Admit``; True if it was queued."""
    refusal = state.on_admit(msg)
    try:
        msg.decision.send_nowait(refusal)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        if refusal is None:  # the caller gave up waiting for the answer
            state.on_withdraw(msg.request_id)
        refusal = refusal or RuntimeShutDown("the caller left")
    msg.decision.close()
    if refusal is not None:
        msg.events.close()
        return False
    return True
