"""Input packing: a committed plan plus the planner's request table become one
``gpu.frames`` value (the host inputs the program's ``bind`` copies into its static
buffers) and the per-lane context the validator checks against (VER-28).

Owns three rules:

- **KV extents.** A prompt lane writes positions ``prompt_start ..
  prompt_start + prompt_tokens``; an ordinary decode lane writes its pending token at
  ``prompt_len + decodes_before`` (every decode so far, queued ones included, since a
  decode frame can be queued behind another), one position earlier for a request that
  decodes its last prompt token (``decodes_prompt_tail``: its row starts with that
  token pending). The allocator reserves pages covering those extents before commit
  (QUEUE-49).
- **State updates ride with the frame.** A request's first frame copies the cached
  page its grant names into its own last page (``PageCopy``), initialises its row
  (``RowInit``: position = cached prefix, sampling parameters) and appends its cached
  pages; every frame appends the pages reserved for it. They are applied in stream
  order inside ``bind``, so the runtime never writes device state behind a queued
  frame's back.
- **Speculative rounds** (``GraphKind.SPECULATIVE``) become a ``SpeculativeFrame``:
  one row and one limit per lane, the limit being the lane's ``token_ceiling`` (the
  exact host query length under ``QueryLength``, the immutable ceiling under
  ``SpeculativePrefixLimit``). Pages are reserved for the whole limit; a round emits
  between 1 and ``limit`` tokens, and ``settle_decodes`` gives back the difference
  once the frame is validated so that later extents stay exact upper bounds.
- **Speculative mixed frames** (``GraphKind.MIXED`` with ``MixedRole.decode_mode``
  SPECULATIVE, the wider ``speculation_enabled`` mixed programs; seed *Mixed execution
  contract*) become a ``SpeculativeMixedFrame``: the prompt lane (if any) at
  ``prefill_row`` with limit 0 and its chunk, then the decode lanes with their
  ``token_ceiling`` as exact host query lengths, reserved and settled like a
  speculative round's. Ordinary mixed plans stay ``MixedFrame``.
- **Lane order is plan order.** Rows, samples and records line up lane by lane.
- **Grammar masks** (structured output): with host grammars every constrained lane
  that samples carries the bitmask its matcher allows next; the scheduler committed
  the plan only into an empty window (QUEUE-13), so the matcher has seen every token
  before this one. With resident grammars (``gpu.grammar_rows``) the request's first
  frame carries its compiled grammar in the ``RowInit`` and every frame lists the
  constrained rows that sample in ``grammar_rows``: the program computes their masks
  from the tokens it sampled, so the frame may queue behind another. Speculative
  frames carry neither: constrained requests never speculate (SEL-13).
- **Vision frames** (``GraphKind.VISION``, the scheduler's vision prerequisite):
  each lane's images (``policy.vision_windows.vision_lane_images``: from its first due
  image to its window's end, within the slots the lanes before it left), in lane
  order, as one ``VisionFrame``; it touches no request state, so a vision lane
  neither initialises its row nor reserves pages.
- **Terminal snapshots** (``GraphKind.STATE``, ``StateOp.SNAPSHOT``; PRE-38, PRE-39).
  A terminal lane copies the request's state at its validated KV extent into a
  scratch row and its partial last page into the snapshot destination (without an
  obtainable destination the allocator's plan stops at the last full page and
  nothing partial is copied, QUEUE-25). The frame
  first re-initialises the source row from the host's view (position = written
  extent, block table = the pages covering it), so the copy never depends on device
  state that a discarded decode behind the final token advanced.
- **Window snapshots** (PRE-30..36, ``actors.window_snapshots``). A prompt lane that
  starts a later image window asks the allocator for a snapshot of its request at the
  lane's start (``lane_extent``) and carries the snapshot and restore copies; it is
  packed only when no frame of the request is in flight (PRE-31).

Pure: no trio, no device.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from actors.grammar import RequestGrammar
from actors.image_content import content_ids, frame_images
from actors.messages import (
    Grant,
    LaneContext,
    LaneExtent,
    PageId,
    PagePlan,
    RequestHandle,
    SnapshotPlan,
    StateRow,
)
from actors.public import GenerationRequest
from actors.window_snapshots import snapshot_point, window_copies, window_of
from gpu import (
    NO_PROMPT_ROW,
    DecodeFrame,
    Frame,
    MixedFrame,
    PageAppend,
    PageCopy,
    PrefillFrame,
    RowCopy,
    RowInit,
    SamplingParams,
    SpeculativeFrame,
    SpeculativeMixedFrame,
    StateOpFrame,
    StateUpdate,
    VisionFrame,
)
from policy import (
    DecodeMode,
    GraphKind,
    ImagePlan,
    Lane,
    LaneRole,
    ScheduledPlan,
    StateOp,
    decodes_prompt_tail,
    vision_lane_images,
)

PackedFrame = Frame | SpeculativeFrame | SpeculativeMixedFrame
"""Every frame value ``pack_frame`` produces."""


class PackingError(ValueError):
    """Raised when a plan cannot be turned into a frame (a kind flare does not run)."""


@dataclass(slots=True, kw_only=True)
class LaneSource:
    """What the planner knows about one resident request, for packing."""

    handle: RequestHandle
    epoch: int
    row: StateRow
    request: GenerationRequest
    cached_tokens: int
    cached_pages: tuple[PageId, ...]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    initialised: bool = False
    decodes_submitted: int = 0
    output_ids: list[int] = field(default_factory=list)
    grammar: RequestGrammar | None = None
    """The request's grammar matcher (structured output), None when unconstrained."""
    image_plan: ImagePlan | None = None
    """Its prompt's image windows (``actors.image_content.image_plan``)."""
    grammar_resident: bool = False
    """The programs hold a copy of that grammar per row (``gpu.grammar_rows``)."""
    window: int | None = None
    """The image window its row generation holds (``actors.window_snapshots``)."""
    in_flight: int = 0
    """Its lanes submitted and not yet completed (a window snapshot needs none)."""
    decodes_prompt_tail: bool = False
    """Its first decode step feeds its last prompt token (``policy.lifecycle``)."""
    page_copy: tuple[PageId, PageId] | None = None
    """(cached page, its own last cached page): copied by its first frame (``Grant``)."""

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def first_decode_position(self) -> int:
        """Where its first decode step writes its input token's KV."""
        return len(self.prompt) - 1 if self.decodes_prompt_tail else len(self.prompt)

    def written_content(self, kv_tokens: int) -> tuple[int, ...]:
        """The content ids (``actors.image_content``) of the first ``kv_tokens``
        positions it wrote: what the prefix cache publishes them under."""
        prompt = content_ids(self.prompt, self.request.images)
        return (*prompt, *self.output_ids)[:kv_tokens]


def admitted_source(request: GenerationRequest, grant: Grant, *, epoch: int,
                    eos_token_ids: Sequence[int], grammar: RequestGrammar | None,
                    image_plan: ImagePlan | None = None,
                    grammar_resident: bool = False, decodes_prompt_tail: bool = False
                    ) -> LaneSource:
    """The packing view of a request admitted on ``grant``: its sampling always has a
    seed (one is drawn when the request gave none) and its ending ids include its
    ``stop_token_ids``."""
    s = request.sampling
    return LaneSource(
        handle=grant.handle, epoch=epoch, row=grant.row, request=request,
        cached_tokens=grant.cached_tokens, cached_pages=grant.cached_pages,
        sampling=replace(s, seed=s.seed if s.seed is not None else secrets.randbits(63)),
        eos_token_ids=ending_token_ids(request, eos_token_ids), grammar=grammar,
        image_plan=image_plan, grammar_resident=grammar_resident and grammar is not None,
        decodes_prompt_tail=decodes_prompt_tail, page_copy=grant.page_copy)


def decodes_last_token(request: GenerationRequest, cached_tokens: int) -> bool:
    """Whether ``request``, with ``cached_tokens`` of its prompt cached, can feed its
    last prompt token to its first decode step (``policy.lifecycle.decodes_prompt_tail``)."""
    return decodes_prompt_tail(prompt_len=len(request.prompt_token_ids),
                               cached_prefix_len=cached_tokens,
                               scored_prompt=request.prompt_logprobs,
                               has_images=bool(request.images))


def ending_token_ids(request: GenerationRequest, eos_token_ids: Sequence[int]
                     ) -> tuple[int, ...]:
    """Every token id that ends ``request``: the model's EOS ids (unless it ignores
    EOS), then its ``stop_token_ids``; each ends it like EOS (finish reason ``stop``)."""
    eos = () if request.ignore_eos else tuple(eos_token_ids)
    return tuple(dict.fromkeys((*eos, *request.sampling.stop_token_ids)))


def row_init(source: LaneSource, *, row: int, position: int, grammar: bool = False,
             pending_token: int = 0) -> RowInit:
    """A new state row for ``source``'s request: what the row's logit processing needs
    beyond the sampling (the prompt for ``repetition_penalty``, the ending ids for
    ``min_tokens``) travels only when that processing is on; with ``grammar``, a
    resident grammar's compiled text; the row carries as many top alternatives as the
    request asked for."""
    sampling = source.sampling
    held = source.grammar if grammar and source.grammar_resident else None
    return RowInit(
        row=row, position=position, pending_token=pending_token, sampling=sampling,
        prompt_tokens=source.prompt if sampling.repetition_penalty != 1.0 else (),
        end_token_ids=source.eos_token_ids if sampling.min_tokens > 0 else (),
        grammar=held.source if held is not None else "",
        top_logprobs=source.request.top_logprobs,
    )


def kv_extent(lane: Lane, source: LaneSource) -> int:
    """KV positions the request holds once this lane has run."""
    if lane.role is LaneRole.PROMPT:
        return lane.prompt_start + lane.prompt_tokens
    if lane.role is LaneRole.DECODE:
        return source.first_decode_position + source.decodes_submitted + lane.token_ceiling
    return 0


def lane_extent(lane: Lane, source: LaneSource) -> LaneExtent:
    """What the allocator must provide for a non-terminal ``lane``: pages for its KV
    extent, and a window snapshot where it starts a later image window."""
    return LaneExtent(handle=lane.handle, kv_tokens=kv_extent(lane, source),
                      window_snapshot_at=snapshot_point(
                          lane, source.image_plan, window=source.window,
                          initialised=source.initialised))


def _copies(lanes: Sequence[Lane], sources: Mapping[RequestHandle, LaneSource],
            snapshots: Sequence[SnapshotPlan]) -> tuple[RowCopy, ...]:
    """The window snapshot and restore copies of the frame's prompt lane, if it starts
    a later window; refused while a frame of that request is in flight (PRE-31)."""
    by_handle = {s.handle: s for s in snapshots}
    for lane in lanes:
        source = sources[lane.handle]
        at = snapshot_point(lane, source.image_plan, window=source.window,
                            initialised=source.initialised)
        if at is None:
            continue
        snap = by_handle.get(lane.handle)
        if source.in_flight or snap is None or snap.kv_tokens != at:
            raise PackingError(f"request {lane.handle}: a window snapshot at {at} needs its "
                               "reserved snapshot and no frame of the request in flight")
        return window_copies(snap)
    return ()


def _updates(
    lanes: Sequence[Lane], sources: Mapping[RequestHandle, LaneSource],
    pages: Mapping[RequestHandle, PagePlan],
) -> tuple[StateUpdate, ...]:
    updates: list[StateUpdate] = []
    for lane in lanes:
        source = sources[lane.handle]
        if not source.initialised:
            if source.page_copy is not None:
                src, dst = source.page_copy
                updates.append(PageCopy(row=source.row, src_page=src, dst_page=dst))
            updates.append(row_init(
                source, row=source.row, position=source.cached_tokens, grammar=True,
                pending_token=source.prompt[-1] if source.decodes_prompt_tail else 0))
            if source.cached_pages:
                updates.append(PageAppend(row=source.row, first_block=0,
                                          page_ids=tuple(source.cached_pages)))
        plan = pages.get(lane.handle)
        if plan is not None and plan.page_ids:
            updates.append(PageAppend(row=plan.row, first_block=plan.first_block,
                                      page_ids=tuple(plan.page_ids)))
    return tuple(updates)


def _context(lane: Lane, source: LaneSource) -> LaneContext:
    if lane.role is LaneRole.PROMPT:
        samples = lane.prompt_start + lane.prompt_tokens == len(source.prompt)
    else:
        samples = lane.role is LaneRole.DECODE
    return LaneContext(handle=lane.handle, epoch=lane.epoch, row=source.row, samples=samples,
                       eos_token_ids=source.eos_token_ids, grammar=source.grammar)


def _constrained_samples(lanes: Sequence[Lane], sources: Mapping[RequestHandle, LaneSource],
                         *, resident: bool) -> list[LaneSource]:
    """The sources of the constrained lanes that sample, with resident grammars or not."""
    return [source for lane in lanes
            if (source := sources[lane.handle]).grammar is not None
            and source.grammar_resident is resident and _context(lane, source).samples]


def _grammar_rows(lanes: Sequence[Lane], sources: Mapping[RequestHandle, LaneSource]
                  ) -> tuple[int, ...]:
    """The rows whose resident grammar masks the token this frame samples for them."""
    return tuple(s.row for s in _constrained_samples(lanes, sources, resident=True))


def _token_masks(lanes: Sequence[Lane], sources: Mapping[RequestHandle, LaneSource]
                 ) -> tuple[tuple[int, bytes], ...]:
    """``(row, allowed-token bitmask)`` for every lane with a host grammar that samples:
    what its matcher allows after every validated token (completion feedback, QUEUE-13)."""
    constrained = _constrained_samples(lanes, sources, resident=False)
    rows = [s.row for s in constrained]
    grammars: list[RequestGrammar] = [s.grammar for s in constrained if s.grammar is not None]
    if not grammars:
        return ()
    masks = grammars[0].vocabulary.masks(grammars)
    return tuple(zip(rows, masks, strict=True))


def _snapshot_frame(plan: ScheduledPlan, sources: Mapping[RequestHandle, LaneSource],
                    snapshots: Sequence[SnapshotPlan]) -> StateOpFrame:
    by_handle = {s.handle: s for s in snapshots}
    updates: list[StateUpdate] = []
    copies: list[RowCopy] = []
    for lane in plan.lanes:
        if lane.role is not LaneRole.TERMINAL or lane.handle not in by_handle:
            raise PackingError(f"{plan.shape.label()}: lane {lane.handle} is not a "
                               "reserved terminal snapshot")
        snap = by_handle[lane.handle]
        updates.append(row_init(sources[lane.handle], row=snap.row, position=snap.kv_tokens))
        if snap.page_ids:
            updates.append(PageAppend(row=snap.row, first_block=0,
                                      page_ids=tuple(snap.page_ids)))
        copies.append(RowCopy(src_row=snap.row, dst_row=snap.scratch_row,
                              dst_page=snap.dst_page))
    return StateOpFrame(copies=tuple(copies), updates=tuple(updates))


def _vision_frame(plan: ScheduledPlan, sources: Mapping[RequestHandle, LaneSource]
                  ) -> VisionFrame:
    slots, images = plan.shape.batch_capacity, []
    for lane in plan.lanes:
        source = sources[lane.handle]
        if lane.role is not LaneRole.VISION or source.image_plan is None:
            raise PackingError(f"{plan.shape.label()}: lane {lane.handle} has no images")
        lane_images = vision_lane_images(source.image_plan, lane.prompt_start, slots)
        images += [source.request.images[i] for i in lane_images]
        slots -= len(lane_images)
    return VisionFrame(images=tuple(images))


def runs_speculative_mixed(plan: ScheduledPlan) -> bool:
    """Whether ``plan`` is a mixed step with speculative decode rows (packed as a
    ``SpeculativeMixedFrame``, validated as one)."""
    mixed = plan.step.mixed
    return plan.shape.kind is GraphKind.MIXED and mixed is not None \
        and mixed.decode_mode is DecodeMode.SPECULATIVE


def _mixed_frame(plan: ScheduledPlan, sources: Mapping[RequestHandle, LaneSource],
                 updates: tuple[StateUpdate, ...], copies: tuple[RowCopy, ...] = (),
                 ) -> MixedFrame | SpeculativeMixedFrame:
    """An ordinary ``MixedFrame``, or with speculative decode rows a
    ``SpeculativeMixedFrame``; the prompt lane is located by its role (MIX-9)."""
    lanes = plan.lanes
    rows = tuple(sources[lane.handle].row for lane in lanes)
    prompt_row = next((i for i, lane in enumerate(lanes) if lane.role is LaneRole.PROMPT),
                      NO_PROMPT_ROW)
    prompt_tokens: tuple[int, ...] = ()
    prompt_start = 0
    ends = False
    if prompt_row != NO_PROMPT_ROW:
        lane = lanes[prompt_row]
        source = sources[lane.handle]
        prompt_start = lane.prompt_start
        prompt_tokens = source.prompt[prompt_start:prompt_start + lane.prompt_tokens]
        ends = prompt_start + lane.prompt_tokens == len(source.prompt)
    mixed = plan.step.mixed
    speculative = runs_speculative_mixed(plan)
    wider = plan.shape.speculation_enabled and plan.shape.token_capacity > 1
    if speculative != wider:
        # the shape's program takes one frame type: a mismatch is a planning bug
        raise PackingError(f"{plan.shape.label()}: decode mode "
                           f"{mixed.decode_mode.value if mixed else None} does not match "
                           "the program (speculative decode rows need a wider "
                           "speculation_enabled mixed program, and it needs them)")
    images = () if prompt_row == NO_PROMPT_ROW else frame_images(
        sources[lanes[prompt_row].handle].request.images,
        sources[lanes[prompt_row].handle].image_plan, prompt_start)
    if not speculative:
        return MixedFrame(rows=rows, prefill_row=prompt_row, prompt_tokens=prompt_tokens,
                          prompt_start=prompt_start, prompt_ends=ends, updates=updates,
                          token_masks=_token_masks(lanes, sources), images=images,
                          copies=copies, grammar_rows=_grammar_rows(lanes, sources))
    assert mixed is not None
    if images or copies:
        raise PackingError(f"{plan.shape.label()}: speculative mixed programs do not read "
                           "image features (docs/vision.md)")
    if mixed.prefill_row != prompt_row:
        raise PackingError(f"{plan.shape.label()}: the plan's prefill_row "
                           f"{mixed.prefill_row} is not its prompt lane {prompt_row}")
    return SpeculativeMixedFrame(
        rows=rows, limits=tuple(0 if i == prompt_row else lane.token_ceiling
                                for i, lane in enumerate(lanes)),
        prefill_row=prompt_row, prompt_tokens=prompt_tokens, prompt_start=prompt_start,
        prompt_ends=ends, updates=updates)


def pack_frame(
    plan: ScheduledPlan,
    sources: Mapping[RequestHandle, LaneSource],
    pages: Sequence[PagePlan],
    snapshots: Sequence[SnapshotPlan] = (),
) -> tuple[PackedFrame, tuple[LaneContext, ...]]:
    """The frame value and lane contexts for ``plan`` (sources must hold every lane)."""
    if plan.shape.kind is GraphKind.STATE:
        if plan.shape.state_op is not StateOp.SNAPSHOT:
            # Restores are planned only for requests admitted as restorable, which
            # the runtime never does (docs/runtime.md); page copies and
            # initialisation have no lane role in the scheduler.
            raise PackingError(f"{plan.shape.label()}: the runtime runs only terminal "
                               "snapshots among state operations")
        contexts = tuple(_context(lane, sources[lane.handle]) for lane in plan.lanes)
        return _snapshot_frame(plan, sources, snapshots), contexts
    if plan.shape.kind is GraphKind.VISION:
        contexts = tuple(_context(lane, sources[lane.handle]) for lane in plan.lanes)
        return _vision_frame(plan, sources), contexts
    by_handle = {p.handle: p for p in pages}
    lanes = plan.lanes
    updates = _updates(lanes, sources, by_handle)
    copies = _copies(lanes, sources, snapshots)
    contexts = tuple(_context(lane, sources[lane.handle]) for lane in lanes)
    kind = plan.shape.kind
    frame: PackedFrame
    if kind is GraphKind.SPECULATIVE:
        frame = SpeculativeFrame(rows=tuple(sources[lane.handle].row for lane in lanes),
                                 limits=tuple(lane.token_ceiling for lane in lanes),
                                 updates=updates)
    elif kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        (lane,) = lanes
        source = sources[lane.handle]
        end = lane.prompt_start + lane.prompt_tokens
        frame = PrefillFrame(
            row=source.row, tokens=source.prompt[lane.prompt_start:end],
            start_position=lane.prompt_start, ends_prompt=end == len(source.prompt),
            following_token=source.prompt[end] if end < len(source.prompt) else -1,
            updates=updates, token_masks=_token_masks(lanes, sources),
            images=frame_images(source.request.images, source.image_plan, lane.prompt_start),
            copies=copies, grammar_rows=_grammar_rows(lanes, sources),
        )
    elif kind is GraphKind.DECODE:
        frame = DecodeFrame(rows=tuple(sources[lane.handle].row for lane in lanes),
                            updates=updates, token_masks=_token_masks(lanes, sources),
                            grammar_rows=_grammar_rows(lanes, sources))
    elif kind is GraphKind.MIXED:
        frame = _mixed_frame(plan, sources, updates, copies)
    else:
        raise PackingError(f"{plan.shape.label()}: the runtime does not run {kind.value} frames")
    return frame, contexts


def mark_submitted(plan: ScheduledPlan, sources: Mapping[RequestHandle, LaneSource]) -> int:
    """After commit: rows are initialised, decode counts include this frame, and prompt
    lanes' row generations hold their active windows. A vision lane touches no row, so
    it neither initialises one nor counts as the request's frame in flight (a window
    snapshot drains only frames that read or write the row). Returns the window
    snapshots the frame runs."""
    snapshots = 0
    for lane in plan.lanes:
        source = sources[lane.handle]
        if lane.role is LaneRole.VISION:
            continue
        snapshots += snapshot_point(lane, source.image_plan, window=source.window,
                                    initialised=source.initialised) is not None
        source.initialised = True
        source.in_flight += 1
        if lane.role is LaneRole.DECODE:
            source.decodes_submitted += lane.token_ceiling
        window = window_of(source.image_plan, lane.prompt_start)
        if lane.role is LaneRole.PROMPT and window is not None:
            source.window = window
    return snapshots


def settled(lane: Lane, source: LaneSource, *, ok: bool) -> bool:
    """A completed frame's ``lane`` left flight; whether it applies to ``source`` (its
    epoch, and the lane succeeded)."""
    if source.epoch != lane.epoch:
        return False
    if lane.role is not LaneRole.VISION:
        source.in_flight -= 1
    return ok


def settle_decodes(lane: Lane, source: LaneSource, emitted: int) -> None:
    """After a validated decode lane: count what it emitted, not its ceiling."""
    if lane.role is LaneRole.DECODE:
        source.decodes_submitted -= lane.token_ceiling - emitted
