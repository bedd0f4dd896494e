"""Packed step programs: prefill, scored prefill, decode and mixed.

Owns the one fixed-shape forward every generation-side program runs: gather the
packed tokens (host prompt tokens, or each decode lane's pending token from device
state), write their K/V into the page pool, run one shared target forward over all
packed tokens (MIX-33), project each lane's last token to the vocabulary, sample, and
commit the results into device request state (MIX-34): the pending token of lanes
that sampled, and every lane's position. Inactive lanes address the sink row and
padding slots the sink page, so they mutate nothing (MIX-15).

``execute`` is capturable under ``ExecutionOptions.static()``: fixed shapes, no host
sync, no data-dependent control flow. Under ``ExecutionOptions.eager()`` (the CPU
default) ``bind`` also chooses host-known bounds (context blocks per phase, whether any
lane samples stochastically) that ``execute`` follows; see ``gpu.programs.execution``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from gpu.frames import (
    NO_PROMPT_ROW,
    RESULT_KEY,
    DecodeFrame,
    FrameError,
    ImageSpan,
    MixedFrame,
    PrefillFrame,
    RowCopy,
    StateUpdate,
    VisionFrame,
    frame_of,
)
from gpu.grammar_mask import TokenMasks
from gpu.model.batch import PhaseSplit
from gpu.model.capture import ForwardCapture
from gpu.model.decoder import Decoder
from gpu.model.graph_cache import source_digest
from gpu.model.kv_cache import PagedKVCache
from gpu.programs.execution import ExecutionOptions, context_blocks
from gpu.programs.packing import HostPack, PackLimits, pack_lanes
from gpu.programs.state_ops import apply_copies, check_copies
from gpu.programs.step_body import (
    STEP_SOURCES,
    StepConfig,
    StepOutputs,
    StepState,
    run_step,
    step_tensors,
    traced_step,
)
from gpu.programs.step_readout import StepReadout
from gpu.programs.vision import ChunkImage, VisionProgram, chunk_images
from gpu.programs.workspace import Workspace
from gpu.request_state import RequestState
from policy.descriptors import GraphKind, GraphShape

_STEP_KINDS = (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.DECODE, GraphKind.MIXED)
STEP_GRAPH_MAX_PROMPT = 64
"""Programs with at most this many prompt tokens a frame replay a whole-step graph
(``gpu.programs.step_body``); longer prompt chunks replay only the forward graph: their
forward dwarfs the interpreter's share of the step, and a second graph per large program
would lengthen start-up by about half (``docs/runtime.md``)."""


@dataclass(frozen=True, slots=True)
class StagedFrame:
    """A validated frame packed into its own host block, ready for ``bind_staged``."""

    program: StepProgram
    pack: HostPack
    updates: tuple[StateUpdate, ...]
    block: np.ndarray
    token_masks: np.ndarray | None = None
    """The frame's grammar masks (``TokenMasks.stage``), None when unconstrained."""
    images: tuple[ChunkImage, ...] = ()
    """The image positions the prompt lane covers, at their packed rows."""
    window: tuple[ImageSpan, ...] = ()
    """The images the frame asks the vision program for (its active window)."""
    image_row: tuple[int, bool] = (-1, False)
    """The prompt lane's row and whether the chunk ends its prompt (``VisionProgram``)."""
    copies: tuple[RowCopy, ...] = ()
    """Row copies run before ``updates`` (a window snapshot and its restore)."""
    grammar_lanes: tuple[tuple[int, int], ...] = ()
    """``(lane, row)`` of the lanes whose resident grammar masks them (``bind``
    computes those masks, ``execute`` advances the matchers; ``gpu.grammar_rows``)."""


class StepProgram:
    """A prepared prefill / scored-prefill / decode / mixed program of one shape."""

    def __init__(
        self,
        shape: GraphShape,
        *,
        decoder: Decoder,
        cache: PagedKVCache,
        state: RequestState,
        workspace: Workspace,
        execution: ExecutionOptions | None = None,
        vision: VisionProgram | None = None,
    ) -> None:
        if shape.kind not in _STEP_KINDS:
            raise ValueError(f"StepProgram cannot run {shape.kind}")
        if shape.kind is GraphKind.MIXED and shape.token_capacity != 1:
            raise ValueError("mixed programs support decode width 1 (wider widths: speculative)")
        self._shape = shape
        self._decoder = decoder
        self._cache = cache
        self._state = state
        self.scored = shape.kind is GraphKind.SCORED_PREFILL
        kind = shape.kind
        tokens = shape.max_packed_extent
        lanes = shape.batch_capacity
        prompt_capacity = {
            GraphKind.MIXED: shape.prefill_capacity,
            GraphKind.DECODE: 0,
        }.get(kind, shape.token_capacity)
        self.limits = PackLimits(
            token_slots=tokens, lanes=lanes, decode_width=shape.token_capacity,
            prompt_capacity=prompt_capacity, state_rows=state.rows, sink_row=state.sink_row,
            vocab_size=decoder.config.vocab_size, max_context=cache.geometry.max_context,
        )
        self.buffers = workspace.packed_views(
            tokens, lanes, prompt_capacity=prompt_capacity, decode_width=shape.token_capacity
        )
        self._workspace = workspace
        self._vision = vision
        self._image_features: tuple[torch.Tensor, torch.Tensor] | None = None
        """The bound frame's image feature rows (``PackedBatch.image_features``)."""
        self._bound: HostPack | None = None
        self._buffer_tensors = step_tensors(self.buffers)
        """The buffers as a traced step's leading graph inputs (``gpu.programs.step_body``)."""
        self._step_key = (source_digest(STEP_SOURCES), kind, cache.geometry, state.rows,
                          state.block_table.shape[1],
                          *((tuple(t.shape), t.dtype) for t in self._buffer_tensors))
        """What a traced step's graph depends on besides the host constants: the
        buffers' shapes and the state's rows (not the sliced tables' width, which the
        graph follows)."""
        self._traces_step = prompt_capacity <= STEP_GRAPH_MAX_PROMPT
        """Whether plain frames (greedy or sampled) replay the whole step (``STEP_GRAPH_MAX_PROMPT``)."""
        self._step_captured = not self._traces_step
        """Whether this program's plain step graphs are captured (or not wanted)."""
        self._host_outputs = (_OutputArrays.of(self.buffers)
                              if self.buffers.out_token.device.type == "cpu" else None)
        """Views of the output buffers read without a copy per call (CPU only)."""
        self.execution = execution or ExecutionOptions.static()
        self._token_masks = TokenMasks(
            lanes, decoder.config.vocab_size, device=self.buffers.out_token.device,
            always_apply=not self.execution.host_bounds)
        """Grammar masks of the bound frame's lanes (structured output)."""
        self._grammar_lanes: tuple[tuple[int, int], ...] = ()
        """The bound frame's resident-grammar lanes (``StagedFrame.grammar_lanes``)."""
        geo = cache.geometry
        # host-known bounds chosen in bind (static options: the full row, always sample)
        self.context_blocks = geo.blocks_per_row
        """Blocks of each lane's table that attention gathers (decode phase in mixed)."""
        self.prompt_blocks = geo.blocks_per_row
        """Blocks of the prompt lane's table that mixed prompt attention gathers."""
        self.any_sampled = True
        """False when every active lane is greedy and the shortcut is enabled."""
        self.any_processing = True
        """False when no active lane has logit processing on (eager options only)."""
        self.top_width = self.buffers.out_top_token.shape[1]
        """Top alternatives computed per lane: the most any active row asks for (eager)."""
        self.lane_logits: torch.Tensor | None = None
        """The last execution's target logits ``[sampled lanes, V]`` in sample order,
        for a wrapper that compares them with a draft's (``gpu.draft_state``)."""
        # decode packs lane i at slots i*W..: attention can run per lane (a static choice)
        self._lane_major_width = shape.token_capacity if kind is GraphKind.DECODE else 0
        # mixed: prompt and decode queries attend in their own fixed phase workspaces
        self._phase_split = (
            PhaseSplit(prompt_slots=self.buffers.prompt_slots,
                       prompt_lane=self.buffers.prompt_lane,
                       decode_slots=self.buffers.decode_slots, width=shape.token_capacity)
            if kind is GraphKind.MIXED else None
        )

    @property
    def shape(self) -> GraphShape:
        return self._shape

    @property
    def holds_grammars(self) -> bool:
        """The program's declared capability: constrained rows' grammars are resident
        in its request state (``gpu.grammar_rows``), so their frames list
        ``grammar_rows`` instead of carrying host masks and need no completion feedback."""
        return self._state.grammars is not None

    # ------------------------------------------------------------------ bind

    def stage(self, inputs: Mapping[str, Any]) -> StagedFrame:
        """Validate a frame and pack it into a fresh host block; touches no device or
        shared state, so a backend may call it at launch, off the stream, while earlier
        frames still run (``bind_staged`` then only uploads it, in stream order)."""
        frame = frame_of(inputs)
        if isinstance(frame, VisionFrame):
            raise FrameError(f"{self._shape.label()}: a vision frame runs on a vision program")
        self._state.validate_updates(frame.updates)
        block = self._workspace.host_block()
        pack, updates = self.pack(inputs, out=block)
        masks = self._token_masks.stage(pack.rows, getattr(frame, "token_masks", ()))
        images, image_row = self._chunk_images(frame, pack)
        copies = getattr(frame, "copies", ())
        check_copies(self._state, copies)
        if any(c.sampling is not None for c in copies):
            raise FrameError("a prompt frame's row copies keep the copied sampling")
        return StagedFrame(program=self, pack=pack, updates=updates, block=block, copies=copies,
                           token_masks=masks, images=images, image_row=image_row,
                           window=getattr(frame, "images", ()),
                           grammar_lanes=self._grammar_lanes_of(
                               pack.rows, getattr(frame, "grammar_rows", ()), masks))

    def _chunk_images(self, frame: Any, pack: HostPack
                      ) -> tuple[tuple[ChunkImage, ...], tuple[int, bool]]:
        """Where the frame's image positions sit in the packed layout, and the prompt
        lane's row and prompt end; a frame with images needs a vision tower and an
        uncaptured execution (a CUDA graph replays the token embeddings it was
        captured with)."""
        spans = getattr(frame, "images", ())
        if not spans:
            return (), (-1, False)
        if self._vision is None:
            raise FrameError("a frame with images needs a vision-language checkpoint")
        if self.buffers.out_token.device.type == "cuda":
            raise FrameError("captured CUDA programs do not read image features")
        if isinstance(frame, PrefillFrame):
            lane, start, count = 0, frame.start_position, len(frame.tokens)
            row, ends = frame.row, frame.ends_prompt
        else:
            lane, start, count = frame.prefill_row, frame.prompt_start, len(frame.prompt_tokens)
            row, ends = frame.rows[lane], frame.prompt_ends
        return chunk_images(spans, prompt_start=start, prompt_len=count,
                            packed_offset=int(pack.offsets[lane])), (row, ends)

    def _grammar_lanes_of(self, rows: tuple[int, ...], grammar_rows: tuple[int, ...],
                          masks: np.ndarray | None) -> tuple[tuple[int, int], ...]:
        """The ``(lane, row)`` pairs of a frame's resident-grammar rows (validated)."""
        if not grammar_rows:
            return ()
        if self._state.grammars is None:
            raise FrameError(f"{self._shape.label()} holds no resident grammars")
        if masks is not None:
            raise FrameError("a frame carries host masks or resident grammar rows, not both")
        lane_of = {row: i for i, row in enumerate(rows)}
        missing = [row for row in grammar_rows if row not in lane_of]
        if missing:
            raise FrameError(f"grammar rows {missing} are not in the frame")
        return tuple((lane_of[row], row) for row in grammar_rows)

    def pack(
        self, inputs: Mapping[str, Any], *, out: np.ndarray | None = None
    ) -> tuple[HostPack, tuple[Any, ...]]:
        """Validate a frame against this program and lay it out in host block ``out``
        (a fresh one when None); raises ``FrameError`` before writing anything."""
        frame = frame_of(inputs)
        lim = self.limits
        host = self._workspace.host_views(
            self._workspace.host_block() if out is None else out, lim.token_slots,
            lim.lanes, prompt_capacity=lim.prompt_capacity, decode_width=lim.decode_width)
        kind = self._shape.kind
        if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            if not isinstance(frame, PrefillFrame):
                raise FrameError(f"{self._shape.label()} takes a PrefillFrame")
            if self.scored and frame.following_token >= 0 and frame.ends_prompt:
                raise FrameError("a chunk that ends the prompt has no following token")
            pack = pack_lanes(
                self.limits, rows=(frame.row,), prefill_row=0, prompt_tokens=frame.tokens,
                prompt_start=frame.start_position, prompt_ends=frame.ends_prompt,
                following_token=frame.following_token, out=host,
            )
        elif kind is GraphKind.DECODE:
            if not isinstance(frame, DecodeFrame):
                raise FrameError(f"{self._shape.label()} takes a DecodeFrame")
            pack = pack_lanes(
                self.limits, rows=frame.rows, prefill_row=NO_PROMPT_ROW, prompt_tokens=(),
                prompt_start=0, prompt_ends=False, out=host,
            )
        else:
            if not isinstance(frame, MixedFrame):
                raise FrameError(f"{self._shape.label()} takes a MixedFrame")
            pack = pack_lanes(
                self.limits, rows=frame.rows, prefill_row=frame.prefill_row,
                prompt_tokens=frame.prompt_tokens, prompt_start=frame.prompt_start,
                prompt_ends=frame.prompt_ends, out=host,
            )
        return pack, frame.updates

    def bind(self, inputs: Mapping[str, Any]) -> None:
        self.bind_staged(self.stage(inputs))

    def bind_staged(self, staged: StagedFrame) -> None:
        """Apply a staged frame's state updates, upload its host block in one copy and
        choose the host bounds (in stream order, right before ``execute``)."""
        if staged.program is not self:
            raise FrameError(f"frame staged for {staged.program.shape.label()}, "
                             f"bound to {self._shape.label()}")
        apply_copies(self._state, self._cache, staged.copies)
        self._state.apply_updates(staged.updates)
        if self._vision is not None:
            self._vision.initialised(staged.updates, staged.copies)
        self._workspace.upload(staged.block)
        grammars = self._state.grammars
        self._grammar_lanes = staged.grammar_lanes
        if staged.grammar_lanes and grammars is not None:
            self._token_masks.upload(grammars.mask_block(self._shape.batch_capacity,
                                                         staged.grammar_lanes))
        else:
            self._token_masks.upload(staged.token_masks)
        self._image_features = (self._vision.feature_rows(staged.image_row, staged.window,
                                                          staged.images)
                                if staged.window and self._vision is not None else None)
        self._choose_bounds(staged.pack)
        self._bound = staged.pack

    def _choose_bounds(self, pack: HostPack) -> None:
        """Host-known bounds for the next ``execute`` (eager execution options only).

        Reads the rows' positions and temperatures after this frame's updates; ``bind``
        runs in stream order, so they are what ``execute`` will see. On the CPU they are
        read through the state's numpy views (no tensor round trip), as Python scalars:
        a frame has at most a few dozen lanes, and numpy's per-call cost on arrays that
        small was most of the bind (0.14 of 0.2 ms per decode frame).
        """
        opts, st, geo = self.execution, self._state, self._cache.geometry
        if not opts.host_bounds:
            return
        rows = list(pack.rows)
        active = len(rows)
        host = st.host_views
        if opts.dynamic_context:
            positions = (host["position"][rows] if host is not None
                         else _gather_to_host(st.position, rows)).tolist()
            absolute = pack.absolute_position[:active].tolist()
            advance = pack.advance[:active].tolist()
            decode_end = max((p + a for p, a, ab in zip(positions, advance, absolute, strict=True)
                              if ab < 0), default=0)
            prompt_end = max((ab for ab in absolute if ab >= 0), default=0)
            bound = {"page_size": geo.page_size, "blocks_per_row": geo.blocks_per_row}
            cap = geo.max_context
            if self._phase_split is not None:
                self.context_blocks = context_blocks(min(decode_end, cap), **bound)
                self.prompt_blocks = context_blocks(min(prompt_end, cap), **bound)
            else:
                self.context_blocks = context_blocks(min(max(decode_end, prompt_end), cap),
                                                     **bound)
        if opts.greedy_shortcut:
            temperature = (host["temperature"][rows] if host is not None
                           else _gather_to_host(st.temperature, rows)).tolist()
            # sample()'s greedy test is ``temperature <= 0``; NaN counts as sampled
            self.any_sampled = any(not t <= 0.0 for t in temperature)
            self.any_processing = st.any_processing(rows)
            asked = (host["top_logprobs"][rows] if host is not None
                     else _gather_to_host(st.top_logprobs, rows)).max(initial=0)
            self.top_width = min(int(asked), self.buffers.out_top_token.shape[1])

    # --------------------------------------------------------------- execute

    def execute(self) -> None:
        b, st = self.buffers, self._state
        rows = b.lane_rows
        state = StepState(
            position=st.position, pending_token=st.pending_token, block_table=st.block_table,
            context_table=st.block_table[:, :self.context_blocks], temperature=st.temperature,
            top_p=st.top_p, top_k=st.top_k, seed=st.seed,
            prompt_table=(st.block_table[:, :self.prompt_blocks]
                          if self._phase_split is not None and self.execution.dynamic_context
                          else None),
            token_mask=self._token_masks.current)
        config = StepConfig(
            scored=self.scored, lane_major_width=self._lane_major_width,
            split_width=-1 if self._phase_split is None else self._phase_split.width,
            greedy_only=not self.any_sampled, top_width=self.top_width,
            processed_logprobs=self.execution.processed_logprobs,
            masked=state.token_mask is not None)
        capture = self._decoder.capture

        def op_by_op() -> StepOutputs:
            return run_step(self._decoder, self._cache, b, state, config,
                            split=self._phase_split, image_features=self._image_features,
                            processing=st.processing(rows) if self.any_processing else None)

        whole = capture is not None and self._traces_step and self._replays_whole_step(config)
        if capture is not None and not self._step_captured:
            # a first launch captures the plain steps of greedy and of sampled frames
            # (their outputs are overwritten below), so no later frame traces mid-load
            plain = state._replace(token_mask=None)
            for greedy in (True, False):
                variant = replace(config, greedy_only=greedy, top_width=0, masked=False)
                if not (whole and variant == config):
                    self._replay_step(capture, plain, variant, trace_only=True)
        if whole:
            assert capture is not None
            # the whole step replays one traced graph (``gpu.programs.step_body``); its
            # first trace also captures the forward graph the other frames replay
            out = StepOutputs(*self._replay_step(capture, state, config, prepare=op_by_op))
        else:
            out = op_by_op()
            if self.any_processing:
                st.record_outputs(rows, out.token[:, None], b.commits_token[:, None])
        self.lane_logits = out.lane_logits
        st.pending_token.index_copy_(0, rows, out.new_pending)
        st.position.index_copy_(0, rows, out.new_position)
        if self._grammar_lanes and st.grammars is not None:
            # resident grammars (CPU streams only: the token is already on the host)
            sampled = out.token.tolist()
            st.grammars.advance([row for _, row in self._grammar_lanes],
                                [sampled[lane] for lane, _ in self._grammar_lanes])

    def _replay_step(self, capture: ForwardCapture, state: StepState, config: StepConfig,
                     *, prepare: Callable[[], object] | None = None,
                     trace_only: bool = False) -> Any:
        """The traced step of ``config`` over the bound frame (``ForwardCapture.replay``);
        ``trace_only``: only make sure it is captured."""
        self._step_captured = True
        tensors = [*self._buffer_tensors, *(t for t in state if t is not None)]
        body = traced_step(config, phase_split=self._phase_split is not None,
                           prompt_table=state.prompt_table is not None)
        return capture.replay((self._step_key, config), tensors, self._cache, body,
                              prepare=prepare, trace_only=trace_only)

    def _replays_whole_step(self, config: StepConfig) -> bool:
        """Whether a captured program replays this execution as one traced step: no
        top alternatives, no mask, no logit processing, no image, greedy or sampled
        lanes (the two plain steps a program's first launch captures, so no step graph
        is ever traced mid-load; other frames replay the forward)."""
        return (config.top_width == 0 and not config.masked
                and not self.any_processing and self._image_features is None)

    # ---------------------------------------------------------- read outputs

    def read_outputs(self) -> dict[str, Any]:
        pack = self._bound
        if pack is None:
            raise FrameError("read_outputs before bind")
        b = self.buffers
        sampled = [i for i in range(len(pack.rows)) if pack.reports_sample[i]]
        # Copies of the output buffers (the next launch overwrites them); the Python
        # objects are built by the reader, off the stream (``StepReadout``). Lanes
        # 0..k-1 (every decode frame) are a slice: one memcpy per buffer.
        lanes: list[int] | slice = (slice(0, len(sampled)) if sampled == list(range(len(sampled)))
                                    else sampled)
        out = self._host_outputs if self._host_outputs is not None else _OutputArrays.of(b)
        readout = StepReadout(
            rows=tuple(pack.rows[i] for i in sampled),
            tokens=out.tokens[lanes].copy(), logprobs=out.logprobs[lanes].copy(),
            finite=out.finite[lanes].copy(), top_ids=out.top_ids[lanes, :self.top_width].copy(),
            top_logprobs=out.top_logprobs[lanes, :self.top_width].copy())
        if self.scored:
            n = int(pack.query_lengths[0])
            readout = replace(
                readout, prompt_logprobs=b.out_prompt_logprobs[:n].cpu().numpy().copy(),
                prompt_top_ids=b.out_prompt_top_token[:n].cpu().numpy().copy(),
                prompt_top_logprobs=b.out_prompt_top_logprob[:n].cpu().numpy().copy())
        return {RESULT_KEY: readout}


@dataclass(frozen=True, slots=True)
class _OutputArrays:
    """A step program's per-lane output buffers as host arrays: numpy views of the
    buffers themselves on the CPU (made once), fresh copies from a device."""

    tokens: np.ndarray
    logprobs: np.ndarray
    finite: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @classmethod
    def of(cls, buffers: Any) -> _OutputArrays:
        return cls(*(t.cpu().numpy() for t in (
            buffers.out_token, buffers.out_logprob, buffers.out_finite,
            buffers.out_top_token, buffers.out_top_logprob)))


def _gather_to_host(values: torch.Tensor, rows: list[int]) -> np.ndarray:
    """``values[rows]`` copied to a host array (a device round trip)."""
    index = torch.as_tensor(rows, dtype=torch.int64, device=values.device)
    return values.index_select(0, index).cpu().numpy()

