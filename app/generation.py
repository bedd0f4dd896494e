"""Running one generation for the HTTP layer: admission, event pumping, cancellation,
lifecycle logs and latency metrics.

A *pump* task (in the app's nursery) owns ``runtime.generate(request)`` and forwards its
events over a small channel to an ``EventStream`` that the route consumes. The route may
finish its handler before the body is streamed (Quart sends the body outside the request
context), so the runtime's context manager cannot live in the handler's frame; the pump
keeps it in one task from entry to exit. Closing the ``EventStream`` (client gone,
handler cancelled) cancels the pump, which leaves the ``generate`` block and so cancels
the request in the runtime (public.py: within one frame). If the stream object is dropped
without ever being iterated, a weakref finalizer cancels the pump all the same.

``Inflight`` tracks every running pump so that shutdown can wait for them and, past the
grace period, end them (their clients then get an error event).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from types import TracebackType

import structlog
import trio

from actors import (
    AdmissionError,
    Finished,
    GenerationRequest,
    Runtime,
    RuntimeShutDown,
    StreamEvent,
    TokenDelta,
)
from app.errors import api_error_for
from app.metrics import AppMetrics

log = structlog.get_logger("flare.app.requests")

# Events queued between the pump and the HTTP writer: enough to absorb a burst of
# deltas while the socket is briefly slow, small enough that a stalled client applies
# back-pressure to the pump instead of growing memory.
EVENT_BUFFER = 16

CAUSE_CLIENT = "client_disconnected"
CAUSE_SHUTDOWN = "server_shutdown"


@dataclass(slots=True, eq=False)
class ActiveGeneration:
    request_id: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    abort_reason: str | None = None
    failure: str | None = None


class Inflight:
    """Every admitted generation still running; shutdown waits on it."""

    def __init__(self) -> None:
        self._active: set[ActiveGeneration] = set()
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._active)

    def add(self, active: ActiveGeneration) -> None:
        self._active.add(active)

    def discard(self, active: ActiveGeneration) -> None:
        self._active.discard(active)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_empty(self) -> None:
        while self._active:
            await self._changed.wait()

    def abort_all(self, reason: str) -> int:
        """End every running generation; their clients get ``reason`` as an error."""
        for active in self._active:
            active.abort_reason = reason
            active.scope.cancel()
        return len(self._active)


class RequestObserver:
    """Lifecycle logs and HTTP-side latency metrics for one request (times at the HTTP
    layer, not device times: VER-34)."""

    def __init__(self, metrics: AppMetrics, *, request_id: str, endpoint: str,
                 arrived: float) -> None:
        self.metrics = metrics
        self.log = log.bind(request_id=request_id)
        self.endpoint = endpoint
        self.arrived = arrived
        self.first_output: float | None = None
        self.last_output: float | None = None
        self.completion_tokens = 0
        self.done = False

    def admitted(self, request: GenerationRequest, *, stream: bool) -> None:
        self.log.info("request.admitted", endpoint=self.endpoint,
                      prompt_tokens=len(request.prompt_token_ids),
                      max_tokens=request.max_tokens, stream=stream, client=request.client,
                      message_ends=len(request.message_ends))

    def delta(self, event: TokenDelta) -> None:
        now = time.monotonic()
        count = len(event.token_ids)
        if count == 0:
            return
        self.completion_tokens += count
        if self.first_output is None:
            self.first_output = now
            ttft = now - self.arrived
            self.metrics.time_to_first_token.observe(ttft)
            self.log.info("request.first_token", ttft_ms=round(ttft * 1000, 3))
        elif self.last_output is not None:
            per_token = (now - self.last_output) / count
            for _ in range(count):
                self.metrics.inter_token_latency.observe(per_token)
        self.last_output = now

    def finished(self, event: Finished) -> None:
        self.done = True
        e2e = time.monotonic() - self.arrived
        self.metrics.e2e_latency.observe(e2e)
        self.metrics.requests_finished.labels(event.reason).inc()
        self.metrics.prompt_tokens.inc(event.prompt_tokens)
        self.metrics.generation_tokens.inc(event.completion_tokens)
        self.metrics.observe_finished(event)
        fields = {"finish_reason": event.reason, "prompt_tokens": event.prompt_tokens,
                  "completion_tokens": event.completion_tokens,
                  "cached_prompt_tokens": event.cached_prompt_tokens,
                  "e2e_ms": round(e2e * 1000, 3)}
        if event.reason == "error":
            self.log.error("request.failed", error=event.message or "generation failed", **fields)
        elif event.reason == "cancelled":
            self.log.info("request.cancelled", cause="runtime", **fields)
        else:
            self.log.info("request.finished", **fields)

    def ended_early(self, *, cause: str, failure: str | None) -> None:
        """The stream closed before ``Finished``: client gone, shutdown, or a fault."""
        if self.done:
            return
        self.done = True
        elapsed_ms = round((time.monotonic() - self.arrived) * 1000, 3)
        if failure is not None:
            self.metrics.requests_finished.labels("error").inc()
            self.log.error("request.failed", error=failure,
                           completion_tokens=self.completion_tokens, e2e_ms=elapsed_ms)
        else:
            self.metrics.requests_finished.labels("cancelled").inc()
            self.log.info("request.cancelled", cause=cause,
                          completion_tokens=self.completion_tokens, e2e_ms=elapsed_ms)


class EventStream:
    """The consumer end of one pump; iterate it inside ``async with``."""

    def __init__(self, receive: trio.MemoryReceiveChannel[StreamEvent],
                 active: ActiveGeneration, observer: RequestObserver) -> None:
        self._receive = receive
        self.active = active
        self.observer = observer
        self.finished: Finished | None = None
        # Quart drops a response whose body it never started to send (client gone
        # between handler and body); the pump must not outlive it.
        weakref.finalize(self, active.scope.cancel).atexit = False

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pump (if still running) and record how the request ended."""
        self.active.scope.cancel()
        self._receive.close()
        if self.finished is None:
            cause = CAUSE_SHUTDOWN if self.active.abort_reason else CAUSE_CLIENT
            self.observer.ended_early(cause=cause, failure=self.active.failure)

    def early_end_message(self) -> str:
        """Why the stream ended without ``Finished`` (for the client's error event)."""
        if self.active.abort_reason:
            return self.active.abort_reason
        return self.active.failure or "generation ended unexpectedly"

    # An iterator object rather than an async generator: a consumer cancelled between two
    # events (e.g. while its write stalls) leaves no half-run generator to finalize.
    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self.finished is not None:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        if isinstance(event, TokenDelta):
            self.observer.delta(event)
        elif isinstance(event, Finished):
            self.finished = event
            self.observer.finished(event)
        return event


async def start_generation(runtime: Runtime, nursery: trio.Nursery, inflight: Inflight,
                           request: GenerationRequest, observer: RequestObserver, *,
                           stream: bool) -> EventStream:
    """Admit ``request`` (raising ``ApiError`` when refused) and return its events."""
    send, receive = trio.open_memory_channel[StreamEvent](EVENT_BUFFER)
    active = ActiveGeneration(request_id=request.request_id)
    inflight.add(active)
    try:
        await nursery.start(_pump, runtime, request, send, active, inflight)
    except AdmissionError as exc:
        receive.close()
        raise api_error_for(exc) from None
    except BaseException:
        receive.close()
        inflight.discard(active)
        raise
    observer.admitted(request, stream=stream)
    return EventStream(receive, active, observer)


async def _pump(runtime: Runtime, request: GenerationRequest,
                send: trio.MemorySendChannel[StreamEvent], active: ActiveGeneration,
                inflight: Inflight, *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    started = False
    try:
        async with send:
            try:
                with active.scope:
                    async with runtime.generate(request) as events:
                        task_status.started()
                        started = True
                        async for event in events:
                            await send.send(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the consumer went away; leaving the generate block cancelled it
            except Exception as exc:
                if not started:
                    raise  # nursery.start re-raises it to the route (admission errors)
                # After admission a fault belongs to this request alone; it is recorded
                # before the channel closes so the consumer reports it. It must not take
                # the app's nursery down.
                active.failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.exception("request.pump_failed", request_id=request.request_id)
            if not started:
                # Cancelled (shutdown) while being admitted: refuse rather than hang.
                raise RuntimeShutDown("the server is shutting down")
    finally:
        inflight.discard(active)

