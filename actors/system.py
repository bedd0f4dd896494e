"""The runtime's one assembly point: opens every channel, starts every actor, shuts down.

``open_runtime(config)`` loads the model (``gpu.engine.ModelEngine``) for the catalog
the flags describe (``gpu.catalog``), opens and prepares the backend
(``gpu.backends.open_backend``; CPU by default) and yields a ``Runtime``
(``actors.public.Runtime``). ``open_runtime_with(parts)`` starts the same actors on
parts a caller already built (tests use it with the fake backend).

Channels (house style 1-2: one owner per end, named sizes with reasons; the only
channels opened elsewhere are one-shot reply channels of size one, opened by the task
that asks the question)::

    Runtime ──Admit/Withdraw/CloseAdmission──▶ admission ──Acquire──▶ allocator
    admission ──Admitted/Cancel──▶ planner ──Reserve/Release──▶ allocator
    planner ──FrameOrder──▶ dispatcher ──FrameOutcome──▶ validator
    validator ──FenceRetired──▶ allocator, ──ValidatedFrame──▶ planner
    planner ──Track/PublishFrame/Drop──▶ publisher ──Published──▶ planner

Shutdown is two-phase: leaving ``open_runtime`` closes admission, which ends queued
requests and tells the planner; the planner cancels resident requests, drains the
frames in flight and closes its outboxes, and the close spreads down the chain. A
deadline (``SHUTDOWN_DEADLINE_S``) then cancels whatever is still running.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import trio

from actors import admission, checkpoint_allocator, completion_validator, frame_dispatcher
from actors import planner as planner_actor
from actors import publisher as publisher_actor
from actors.admission import AdmissionLimits, AdmissionState
from actors.calibration import measure_snapshot_programs
from actors.capture_warmup import capture_programs
from actors.catalog_setup import program_batch, served_shapes, snapshot_lanes, state_rows_for
from actors.checkpoint_allocator import AllocatorState
from actors.codec import TokenizerCodec
from actors.config import RuntimeConfig
from actors.context_sizing import device_memory_for, serving_context
from actors.errors import AdmissionError, RuntimeShutDown
from actors.grammar import GrammarVocabulary, load_vocabulary
from actors.image_content import ImageWindowing
from actors.log_defaults import quiet_unless_configured
from actors.messages import (
    AdmissionInbox,
    Admit,
    AllocatorInbox,
    CloseAdmission,
    DispatcherInbox,
    PlannerInbox,
    PublisherInbox,
    RequestId,
    ValidatorInbox,
    Withdraw,
)
from actors.planner import Planner
from actors.planner_records import FrameRecord
from actors.policy_setup import (
    admission_prefill,
    counterfactual_copy_depth,
    grammars_resident,
    learned_counterfactuals,
    make_scheduler,
    runtime_policy,
    seed_estimates,
    structured_output_problem,
)
from actors.public import (
    Finished,
    GenerationRequest,
    ImagePrompting,
    RuntimeStatistics,
    StreamEvent,
    TextCodec,
)
from actors.public import (
    Runtime as PublicRuntime,
)
from actors.publisher import event_buffer_size
from actors.resource_book import ResourceBook
from gpu import (
    Backend,
    CatalogFlags,
    PreparedProgram,
    build_catalog,
    load_served_config,
    open_backend,
)
from gpu.engine import ExecutionOptions, ModelEngine
from policy import (
    DEFAULT_WINDOW_IMAGES,
    FRAME_SLOTS,  # orders and outcomes in transit (QUEUE-10)
    GraphShape,
    PolicyConfig,
    SchedulingPolicy,
    context_limit,
)

log = structlog.get_logger("flare.runtime")

SHUTDOWN_DEADLINE_S = 10.0
"""Phase two of shutdown: frames still running this long after admission closed are
abandoned (a frame is at most a few hundred ms on the CPU backend)."""

ALLOCATOR_INBOX = 16
"""The allocator answers every message at once; a small buffer absorbs bursts (the
validator's retirements and the planner's reservations arrive together)."""

PUBLISHER_INBOX = 16
"""One ``PublishFrame`` per completed frame plus ``Track``/``Drop`` notes; the planner
waits for each ``Published`` before sending the next frame, so a few slots suffice."""

UNBOUNDED = math.inf
"""Only to break a cycle: the planner's inbox (planner -> publisher -> planner), and
admission's (each caller has at most one ``Admit`` awaiting its decision and sends at
most one ``Withdraw``, so it is bounded by the callers; a leaving caller must never
block)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeParts:
    """Everything the actors need, already built."""

    backend: Backend
    programs: Mapping[GraphShape, PreparedProgram]
    codec: TextCodec
    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    page_size: int
    num_pages: int
    state_rows: int
    max_queue: int
    admission_order: str = "fifo"  # RuntimeConfig.admission_order
    prefix_caching: bool = True
    """Whether admission looks prompts up in the prefix cache (``--enable-prefix-caching``)."""
    decode_prompt_tail: bool = True  # RuntimeConfig.decode_prompt_tail
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler_policy: str = "balanced"
    """``--scheduler-policy``: the seed's ``balanced``/``throughput`` or a baseline
    (``fcfs``, ``sarathi``, ``vtc``) behind the same planner interface."""
    speculation: str = "off"
    """``--speculation``: ``off``, or ``fixed``/``adaptive`` with ``draft_source``; the
    planner's scheduler then speculates (``policy.round_speculation``)."""
    draft_source: str = "draft"
    copy_counterfactuals: bool = False  # RuntimeConfig.copy_counterfactuals
    draft_counterfactuals: bool = False  # RuntimeConfig.draft_counterfactuals
    clock_ns: Callable[[], int] = field(default=lambda: int(trio.current_time() * 1e9))
    close_backend: bool = True
    measured_costs: Mapping[GraphShape, int] = field(default_factory=dict)
    """Durations (ns) measured before serving (``actors.calibration``), seeded into the
    scheduler's estimates so that terminal captures have a known cost (QUEUE-22)."""
    grammar: GrammarVocabulary | None = None
    """The vocabulary grammar-constrained requests run on (structured output); None
    refuses them."""
    image_prompting: ImagePrompting | None = None
    """How prompts hold images (vision-language checkpoints); None refuses them."""
    window_images: int = DEFAULT_WINDOW_IMAGES
    """Images one vision window holds (``--vision-feature-images``)."""


class _EventStream:
    """The caller's view of one request's events; stops after ``Finished``."""

    def __init__(self, receive: trio.MemoryReceiveChannel[StreamEvent]) -> None:
        self._receive = receive
        self.finished = False

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self.finished:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        if isinstance(event, Finished):
            self.finished = True
        return event


class Runtime:
    """What ``open_runtime`` yields (satisfies ``actors.public.Runtime``)."""

    def __init__(self, parts: RuntimeParts, *, admission_inbox:
                 trio.MemorySendChannel[AdmissionInbox], admission_state: AdmissionState,
                 book: ResourceBook, planner: Planner) -> None:
        self._parts = parts
        self._admission = admission_inbox
        self._admission_state = admission_state
        self._book = book
        self._planner = planner
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def codec(self) -> TextCodec:
        return self._parts.codec

    @property
    def model_name(self) -> str:
        return self._parts.model_name

    @property
    def image_prompting(self) -> ImagePrompting | None:
        return self._parts.image_prompting

    @property
    def max_context(self) -> int:
        return context_limit(max_context=self._parts.max_context,
                             num_pages=self._parts.num_pages, page_size=self._parts.page_size)

    @contextlib.asynccontextmanager
    async def generate(self, request: GenerationRequest) -> AsyncIterator[_EventStream]:
        """Admit ``request`` (raising its ``AdmissionError`` if refused) and yield its
        events. Leaving early withdraws it: selection stops at once and its stream ends
        ``cancelled``; resources return when its last submitted frame retires."""
        request_id = RequestId(next(self._ids))
        events_send, events_receive = trio.open_memory_channel[StreamEvent](
            event_buffer_size(request))
        decision_send, decision_receive = trio.open_memory_channel[AdmissionError | None](1)
        stream = _EventStream(events_receive)
        submitted = False
        try:
            async with events_receive:
                with decision_receive:
                    try:
                        self._admission.send_nowait(Admit(
                            request_id=request_id, request=request, events=events_send,
                            decision=decision_send, arrived_ns=self._parts.clock_ns(),
                        ))
                        submitted = True
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        raise RuntimeShutDown("the runtime is shut down") from None
                    try:
                        refusal = await decision_receive.receive()
                    except trio.EndOfChannel:
                        refusal = RuntimeShutDown("the runtime is shutting down")
                if refusal is not None:
                    submitted = False
                    raise refusal
                yield stream
        finally:
            if submitted and not stream.finished:
                with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                    self._admission.send_nowait(Withdraw(request_id=request_id))

    def statistics(self) -> RuntimeStatistics:
        """A frozen snapshot read from the actors' state between their steps."""
        sched = self._planner.scheduler.statistics()
        counters = self._planner.counters
        by_requests, cached_only = self._book.page_use()
        return RuntimeStatistics(
            requests_running=self._planner.resident_count,
            requests_waiting=len(self._admission_state.waiting),
            admission_reordered=self._admission_state.reordered,
            kv_pages_used=by_requests, kv_pages_cached=cached_only,
            kv_pages_total=self._book.pages.total,
            prefix_cache_hit_tokens=counters.prefix_hit_tokens,
            prefix_cache_query_tokens=counters.prefix_query_tokens,
            prompt_tokens_total=counters.prompt_tokens,
            generation_tokens_total=counters.generation_tokens,
            executions_by_kind=tuple(sorted(sched.executions.items())),
            execution_ns_by_kind=tuple(sorted(sched.execution_ns.items())),
            executions_by_graph=tuple(sorted(self._planner.executions_by_graph.items())),
            speculative_source=(self._parts.draft_source
                                if self._parts.speculation != "off" else ""),
            speculative_frames=counters.speculative_frames,
            speculative_drafted_tokens=counters.drafted_tokens,
            speculative_accepted_tokens=counters.accepted_tokens,
            speculative_accepted_by_position=tuple(counters.accepted_by_position),
            counterfactual_rounds=counters.counterfactual_rounds,
            counterfactual_drafted_tokens=counters.counterfactual_drafted_tokens,
            counterfactual_accepted_tokens=counters.counterfactual_accepted_tokens,
            window_snapshots=counters.window_snapshots,
        )

    @property
    def device_fault(self) -> str | None:
        lost = self._parts.backend.lost
        return None if lost is None else str(lost)

    def frame_log(self) -> tuple[FrameRecord, ...]:
        """The most recent completed frames, oldest first (benchmarks, diagnostics)."""
        return tuple(self._planner.frame_log)

    @property
    def resources(self) -> ResourceBook:
        """The allocator's book, for tests and diagnostics (read only)."""
        return self._book

    @property
    def scheduler(self) -> SchedulingPolicy:
        """The planner's scheduler, for tests and diagnostics (read only)."""
        return self._planner.scheduler

    def _close_admission(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            self._admission.send_nowait(CloseAdmission())
        self._admission.close()


@contextlib.asynccontextmanager
async def open_runtime_with(parts: RuntimeParts, *,
                            catalog: Sequence[GraphShape]) -> AsyncIterator[Runtime]:
    """Start the six actors on ``parts``; stop them in two phases on exit."""
    admission_send, admission_receive = trio.open_memory_channel[AdmissionInbox](UNBOUNDED)
    allocator_send, allocator_receive = trio.open_memory_channel[AllocatorInbox](
        ALLOCATOR_INBOX)
    planner_send, planner_receive = trio.open_memory_channel[PlannerInbox](UNBOUNDED)
    dispatcher_send, dispatcher_receive = trio.open_memory_channel[DispatcherInbox](FRAME_SLOTS)
    validator_send, validator_receive = trio.open_memory_channel[ValidatorInbox](FRAME_SLOTS)
    publisher_send, publisher_receive = trio.open_memory_channel[PublisherInbox](
        PUBLISHER_INBOX)

    book = ResourceBook(num_pages=parts.num_pages, state_rows=parts.state_rows,
                        page_size=parts.page_size, snapshot_lanes=snapshot_lanes(catalog))
    max_context = context_limit(max_context=parts.max_context, num_pages=parts.num_pages,
                                page_size=parts.page_size)
    scheduler = make_scheduler(parts, catalog, max_context=max_context)
    admission_state = AdmissionState(AdmissionLimits(
        max_context=max_context, vocab_size=parts.vocab_size, max_queue=parts.max_queue,
        prefix_caching=parts.prefix_caching, window_images=parts.window_images,
        decode_prompt_tail=parts.decode_prompt_tail,
        grammar=parts.grammar, structured_output=structured_output_problem(parts)),
        prefill_ns=admission_prefill(parts.admission_order, scheduler, catalog))
    seed_estimates(scheduler, parts.measured_costs, now_ns=parts.clock_ns())
    planner = Planner(
        scheduler,
        to_dispatcher=dispatcher_send,
        to_publisher=publisher_send, to_allocator=allocator_send.clone(),
        eos_token_ids=parts.eos_token_ids, clock_ns=parts.clock_ns,
        counterfactual_depth=counterfactual_copy_depth(parts, scheduler, catalog),
        learned_counterfactuals=learned_counterfactuals(parts, scheduler),
        grammar=parts.grammar, grammar_resident=grammars_resident(parts),
        image_windowing=ImageWindowing.of(catalog, parts.window_images),
        decode_prompt_tail=parts.decode_prompt_tail,
    )
    runtime = Runtime(parts, admission_inbox=admission_send, admission_state=admission_state,
                      book=book, planner=planner)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial_kw(
                checkpoint_allocator.run, allocator_receive, state=AllocatorState(book)))
            await nursery.start(partial_kw(
                publisher_actor.run, publisher_receive, planner_send.clone(),
                decode=parts.codec.decode, eos_token_ids=parts.eos_token_ids,
                clock_ns=parts.clock_ns))
            await nursery.start(partial_kw(
                completion_validator.run, validator_receive, planner_send.clone(),
                allocator_send.clone(), vocab_size=parts.vocab_size))
            await nursery.start(partial_kw(
                frame_dispatcher.run, dispatcher_receive, validator_send,
                backend=parts.backend, programs=parts.programs, clock_ns=parts.clock_ns))
            await nursery.start(partial_kw(planner_actor.run, planner_receive, planner))
            await nursery.start(partial_kw(
                admission.run, admission_receive, admission_send.clone(),
                allocator_send, planner_send, state=admission_state))
            try:
                yield runtime
            finally:
                runtime._close_admission()
                nursery.cancel_scope.deadline = trio.current_time() + SHUTDOWN_DEADLINE_S
    finally:
        with trio.CancelScope(shield=True):  # even when cancelled: join the device threads
            if parts.close_backend:
                await trio.to_thread.run_sync(parts.backend.close)


@contextlib.asynccontextmanager
async def open_runtime(config: RuntimeConfig) -> AsyncIterator[Runtime]:
    """Load the model of ``config``, prepare its catalog on the configured backend
    (CPU by default), and run the actors until the block exits. Logs stay quiet
    (warnings and up) unless the application configured logging (``log_defaults``)."""
    quiet_unless_configured()
    config.validate()
    # cpu: the stream is a device process unless ``--no-device-process``
    backend = open_backend(config.backend, **(
        {"device_process": config.device_process,
         **config.tensor_parallel_options} if config.backend == "cpu" else {}))
    try:
        engine, catalog = await trio.to_thread.run_sync(_load_engine, config, backend.device)
        if config.resident_grammars:  # where the backend's stream allows them
            engine.hold_grammars(backend)
        await trio.to_thread.run_sync(
            lambda: backend.prepare(list(engine.programs.values())))
        if config.capture_forward and backend.name == "cpu":
            await trio.to_thread.run_sync(lambda: capture_programs(backend, engine.programs))
        measured = await trio.to_thread.run_sync(
            lambda: measure_snapshot_programs(backend, engine.programs,
                                              state_rows=engine.state_rows))
    except BaseException:
        backend.close()
        raise
    tokenizer = engine.tokenizer
    geometry = engine.geometry
    grammar, grammar_missing = load_vocabulary(
        tokenizer.to_json(), vocab_size=engine.config.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids)
    if grammar is None:
        log.warning("structured output unavailable", reason=grammar_missing)
    parts = RuntimeParts(
        backend=backend, programs=engine.programs, codec=TokenizerCodec(tokenizer),
        model_name=config.model_dir.name, vocab_size=engine.config.vocab_size,
        eos_token_ids=tuple(tokenizer.eos_token_ids), max_context=geometry.max_context,
        page_size=geometry.page_size, num_pages=geometry.num_pages,
        state_rows=engine.state_rows, max_queue=config.max_queue,
        admission_order=config.admission_order,
        prefix_caching=config.prefix_caching, decode_prompt_tail=config.decode_prompt_tail,
        scheduler_policy=config.scheduler_policy,
        speculation=config.speculation, draft_source=config.draft_source,
        copy_counterfactuals=config.copy_counterfactuals,
        draft_counterfactuals=config.draft_counterfactuals,
        policy=runtime_policy(config),
        measured_costs=measured, grammar=grammar, image_prompting=image_prompting(engine),
        window_images=config.vision_feature_images,
    )
    log.info("runtime ready", model=parts.model_name, backend=backend.name,
             ranks=config.tensor_parallel_size,
             dtype=str(engine.dtype).removeprefix("torch."),
             programs=len(engine.programs), pages=parts.num_pages, rows=parts.state_rows)
    async with open_runtime_with(parts, catalog=catalog) as runtime:
        yield runtime


def _load_engine(config: RuntimeConfig, device: str) -> tuple[ModelEngine, tuple[GraphShape, ...]]:
    model, vision = load_served_config(config.model_dir)  # a vision checkpoint: its parts
    sizing = serving_context(config, model_max_context=model.max_context,
                             memory=device_memory_for(config, device, model))
    max_context = sizing.max_context
    speculative = config.speculation != "off"
    catalog = build_catalog(CatalogFlags(
        max_batch=program_batch(config.max_batch),
        prefill_capacities=config.prefill_capacities,
        mixed_prefill=config.mixed_prefill,
        # CAT-13: mixed programs only for model families that declare mixed capture.
        family_supports_mixed=model.mixed_capture,
        # Off by default: terminal checkpoints are then host-side page publication;
        # on, every normal completion ends with a scheduled SNAPSHOT frame
        # (docs/runtime.md, "Terminal snapshot frames").
        state_operations=config.state_operations,
        # A speculative load adds complete speculative programs (SPEC-2, SPEC-12).
        draft_depth=config.draft_depth if speculative else 0,
        speculative_mixed=config.speculative_mixed,
        speculative_token_capacity=config.speculative_token_capacity,
        # adaptive selection may add device-allocated ragged programs (SPEC-17, SPEC-22)
        device_allocation=speculative and config.speculative_allocation == "device",
    ))
    shapes = served_shapes(catalog.shapes, config, vision)
    num_pages = sizing.num_pages
    engine = ModelEngine.load(
        config.model_dir, device=device, dtype=config.dtype, catalog=shapes,
        page_size=config.page_size, num_pages=num_pages,
        state_rows=state_rows_for(config.max_batch) + snapshot_lanes(shapes),
        max_context=max_context,
        execution=ExecutionOptions.for_device(
            device, capture_forward=config.capture_forward,
            processed_logprobs=config.logprobs_mode == "processed_logprobs"),
        speculation_source=config.draft_source if speculative else None,
        draft_model_dir=config.draft_model_dir,
        draft_catch_up=config.draft_catch_up, vision_feature_images=config.vision_feature_images,
        hold_model=config.tensor_parallel_size == 1,  # ranks read their own shards
    )
    return engine, shapes


def image_prompting(engine: ModelEngine) -> ImagePrompting | None:
    vision = engine.vision
    return None if vision is None else ImagePrompting(
        image_token_id=vision.config.image_token_id,
        tokens_per_image=vision.config.tokens_per_image)


def partial_kw(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """``functools.partial`` that keeps ``task_status`` for ``nursery.start``."""

    async def start(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await fn(*args, task_status=task_status, **kwargs)

    start.__name__ = getattr(fn, "__module__", "actor")
    return start


if TYPE_CHECKING:  # ``Runtime`` satisfies the public protocol (checked by mypy --strict).
    _RUNTIME_IS_PUBLIC: type[PublicRuntime] = Runtime
