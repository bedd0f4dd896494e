"""publisher: turns committed tokens into each client's stream events.

Architecture step 6; seed *Service accounting and publication*. The text decisions
live in ``actors/text_stream.py``; this actor owns the client event channels (it
receives each one with ``Track`` and closes it after the ``Finished`` event) and
reports every processed fence to the planner with ``Published`` (OPEN-20: also when
nothing became visible), carrying the host time each visible burst was written so
output age is exact (ACCT-18).

When is ``Finished`` sent? Errors end a stream at once. Otherwise the publisher ends
the text when the scheduler ends the request (EOS, ``max_tokens``) or when it sees a
stop string (a host stop the scheduler cannot see; reported as ``HostFinish``), and
then waits for the planner's ``Drop``, which the planner sends right after the
request's resources were released and its terminal checkpoint published (a pending
terminal capture completes first, PRE-38), or, when only a frame still in flight
delays the release, right after its last tokens (the allocator then holds the
conversation's next turn until the checkpoint is published). A client that
reads ``Finished`` and sends its next turn therefore always finds that checkpoint in
the prefix cache (PRE-53, OPEN-35).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import trio

from actors.messages import (
    Drop,
    EpochRenewed,
    EventSender,
    HostFinish,
    PlannerInbox,
    Published,
    PublisherInbox,
    PublishFrame,
    RequestHandle,
    RequestId,
    Track,
)
from actors.public import (
    Alternatives,
    Finished,
    FinishReason,
    GenerationRequest,
    PromptScores,
    StreamEvent,
)
from actors.text_stream import Decode, OutputStream
from policy import FinishKind

log = structlog.get_logger("flare.publisher")


def event_buffer_size(request: GenerationRequest) -> int:
    """A client stream never blocks the publisher: every delta carries at least one
    token, so ``max_tokens`` deltas plus prompt scores and ``Finished`` always fit."""
    return request.max_tokens + 2


@dataclass(slots=True, kw_only=True)
class _Stream:
    request_id: RequestId
    epoch: int
    request: GenerationRequest
    cached_tokens: int
    events: EventSender
    output: OutputStream
    host_finished: FinishReason | None = None
    arrived_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None


def _send(stream: _Stream, event: StreamEvent) -> None:
    # The client may have left; its Withdraw is then on its way to the planner.
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        try:
            stream.events.send_nowait(event)
        except trio.WouldBlock:
            # Cannot happen with ``event_buffer_size``; never let one client stall or
            # crash the publisher if it somehow does.
            log.error("client stream full; event dropped", request_id=stream.request_id)


def _finish(stream: _Stream, reason: FinishReason, message: str = "",
            scheduled_ns: int | None = None) -> None:
    _send(stream, Finished(
        reason=reason, prompt_tokens=len(stream.request.prompt_token_ids),
        completion_tokens=stream.output.completion_tokens,
        cached_prompt_tokens=stream.cached_tokens, message=message,
        **phase_times(stream.arrived_ns, scheduled_ns, stream.first_token_ns,
                      stream.last_token_ns),
    ))
    stream.events.close()


def phase_times(arrived_ns: int | None, scheduled_ns: int | None, first_token_ns: int | None,
                last_token_ns: int | None) -> dict[str, float | None]:
    """``Finished``'s ``queued_s``, ``prefill_s`` and ``decode_s`` from the runtime-clock
    instants: submitted, first frame submitted, first and last output token published."""
    def span(start: int | None, end: int | None) -> float | None:
        return None if start is None or end is None else max(0, end - start) / 1e9

    first = first_token_ns if scheduled_ns is not None else None
    return {"queued_s": span(arrived_ns, scheduled_ns), "prefill_s": span(scheduled_ns, first),
            "decode_s": span(first, last_token_ns)}


def prompt_scores(request: GenerationRequest, chunk_logprobs: Sequence[float],
                  chunk_top: Sequence[Alternatives] = ()) -> PromptScores:
    """``chunk_logprobs[i]`` (``chunk_top[i]``) scores prompt token ``i + 1``; nothing
    predicts token 0."""
    n = len(request.prompt_token_ids)
    values: tuple[float | None, ...] = (None, *(float(v) for v in chunk_logprobs[: n - 1]))
    top: tuple[Alternatives, ...] = ((), *chunk_top[: n - 1]) if chunk_top else ()
    return PromptScores(token_ids=request.prompt_token_ids, logprobs=values, top_logprobs=top)


class PublisherState:
    """The publisher's synchronous core: one ``_Stream`` per resident request."""

    def __init__(self, *, decode: Decode, eos_token_ids: Sequence[int],
                 clock_ns: Callable[[], int]) -> None:
        self._decode = decode
        self._eos = tuple(eos_token_ids)
        self._clock_ns = clock_ns
        self._streams: dict[RequestHandle, _Stream] = {}

    def track(self, msg: Track) -> None:
        self._streams[msg.handle] = _Stream(
            request_id=msg.request_id, epoch=msg.epoch, request=msg.request,
            cached_tokens=msg.cached_tokens, events=msg.events, arrived_ns=msg.arrived_ns,
            output=OutputStream(decode=self._decode, max_tokens=msg.request.max_tokens,
                                eos_token_ids=self._eos, stop=msg.request.stop,
                                ignore_eos=msg.request.ignore_eos,
                                stop_token_ids=msg.request.sampling.stop_token_ids,
                                min_tokens=msg.request.sampling.min_tokens),
        )

    def renew(self, msg: EpochRenewed) -> None:
        """The stream follows its request into a fresh epoch (PRE-32, PRE-34)."""
        stream = self._streams.get(msg.handle)
        if stream is not None and stream.epoch < msg.epoch:
            stream.epoch = msg.epoch

    def _stream(self, handle: RequestHandle, epoch: int) -> _Stream | None:
        stream = self._streams.get(handle)
        return stream if stream is not None and stream.epoch == epoch else None

    def publish(self, msg: PublishFrame) -> Published:
        visible: list[tuple[RequestHandle, int]] = []
        finished: list[HostFinish] = []
        for scored in msg.prompt_scores:
            stream = self._streams.get(scored.handle)
            if stream is not None:
                _send(stream, prompt_scores(stream.request, [v or 0.0 for v in scored.logprobs],
                                            scored.top_logprobs))
        for failure in msg.errors:
            stream = self._stream(failure.handle, failure.epoch)
            if stream is not None:
                del self._streams[failure.handle]
                _finish(stream, "error", failure.message)
        tops = msg.top_logprobs or tuple(() for _ in msg.tokens)
        for token, logprobs, top in zip(msg.tokens, msg.logprobs, tops, strict=True):
            stream = self._stream(token.handle, token.epoch)
            if stream is None:
                continue
            if token.finish is FinishKind.ERROR:
                del self._streams[token.handle]
                _finish(stream, "error", "generation failed")
                continue
            if token.token_ids:
                stream.last_token_ns = self._clock_ns()
                if stream.first_token_ns is None:
                    stream.first_token_ns = stream.last_token_ns
            step = stream.output.push(token.token_ids, logprobs, top)
            if step.delta is not None:
                _send(stream, step.delta)
                visible.append((token.handle, self._clock_ns()))
            if token.finish is not None:
                # The scheduler ended it; ``Finished`` follows the planner's ``Drop``,
                # which comes after the release or the allocator's hold (PRE-53).
                stream.host_finished = stream.output.finish_reason or (
                    "length" if token.finish is FinishKind.LENGTH else "stop")
            elif step.finish is not None and stream.host_finished is None:
                stream.host_finished = step.finish
                finished.append(HostFinish(handle=token.handle, epoch=token.epoch,
                                           reason=step.finish))
        return Published(fence=msg.fence, visible=tuple(visible), finished=tuple(finished))

    def drop(self, msg: Drop) -> None:
        stream = self._stream(msg.handle, msg.epoch)
        if stream is None:
            return
        del self._streams[msg.handle]
        _finish(stream, stream.host_finished or msg.reason, msg.message, msg.scheduled_ns)

    def close_all(self, message: str) -> None:
        for stream in self._streams.values():
            _finish(stream, "cancelled", message)
        self._streams.clear()

    @property
    def tracked(self) -> int:
        return len(self._streams)


async def run(
    inbox: trio.MemoryReceiveChannel[PublisherInbox],
    to_planner: trio.MemorySendChannel[PlannerInbox],
    *,
    decode: Decode,
    eos_token_ids: Sequence[int],
    clock_ns: Callable[[], int],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish until the planner closes the inbox; end any stream still open."""
    state = PublisherState(decode=decode, eos_token_ids=eos_token_ids, clock_ns=clock_ns)
    async with inbox, to_planner:
        task_status.started()
        try:
            async for msg in inbox:
                if isinstance(msg, Track):
                    state.track(msg)
                elif isinstance(msg, PublishFrame):
                    await to_planner.send(state.publish(msg))
                elif isinstance(msg, EpochRenewed):
                    state.renew(msg)
                else:
                    state.drop(msg)
        finally:
            state.close_all("the runtime shut down")
