"""The host side of a complete speculative program (``gpu.programs.speculative``): its
input block and output buffers, frame validation, staging, binding, the host-known
bounds and the read-out.

Host inputs are staged like the step programs' (``gpu.programs.workspace``): ``stage``
validates a frame and packs its lane rows and limits (mixed: and the prompt chunk)
into a fresh host block of the program's ``InputBlock``, with no device or shared
state touched, so the CPU backend runs it at launch on the caller's thread;
``bind_staged`` then applies the frame's state updates, uploads the block in one copy
and chooses the host bounds. ``bind`` is the two in a row. Under the CPU's
eager execution options (``gpu.programs.execution``) ``bind`` also chooses host-known
bounds: the context attention reads, argmax verification when every lane is greedy
(``verify_greedy``, the same result), and whether the last draft step can matter
(``docs/speculative-programs.md``, "CPU execution").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.draft_state import DraftState
from gpu.frames import FRAME_KEY, RESULT_KEY, TOP_LOGPROBS, FrameError, StateUpdate
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import PagedKVCache
from gpu.programs.execution import ExecutionOptions, context_blocks, covering_power_of_two
from gpu.programs.speculative_frames import SpeculativeFrame, SpeculativeReadout
from gpu.programs.workspace import InputBlock
from gpu.request_state import RequestState
from gpu.speculative import PAD_TOKEN
from gpu.speculative.copy_proposals import COPY_MAX_NGRAM
from policy.descriptors import GraphKind, GraphShape, TargetBinding

LEARNED = "draft"
COPY = "copy"
SOURCES = (LEARNED, COPY)


@dataclass(frozen=True, slots=True, kw_only=True)
class StagedRound:
    """A validated speculative frame packed into its own host block, ready for
    ``bind_staged``: the frame, its state updates, the block, and what the host bounds
    need (the lanes' rows and limits, and a prompt chunk's end for mixed frames)."""

    program: SpeculativeBinding
    frame: Any
    updates: tuple[StateUpdate, ...]
    block: np.ndarray
    rows: tuple[int, ...]
    limits: tuple[int, ...]
    extra_end: int = 0


class SpeculativeBinding:
    """A speculative program's buffers and host side; ``SpeculativeProgram`` adds the
    round that ``execute`` runs on the device."""

    def __init__(self, shape: GraphShape, *, decoder: Decoder, cache: PagedKVCache,
                 state: RequestState, draft_state: DraftState, source: str,
                 copy_max_ngram: int = COPY_MAX_NGRAM,
                 execution: ExecutionOptions | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"proposal source {source!r}: choose one of {SOURCES}")
        if source == LEARNED and draft_state.draft is None:
            raise ValueError("a learned-draft program needs a draft model")
        b, w, d = shape.batch_capacity, shape.token_capacity, shape.proposal_depth
        p = self._decode_rows(shape)
        if d != w - 1:
            raise ValueError(f"{shape.label()}: flare programs draft D = W - 1")
        self._shape = shape
        self._decoder, self._cache, self._state, self._draft = decoder, cache, state, draft_state
        self.source = source
        self.copy_max_ngram = copy_max_ngram
        self.batch, self.width, self.depth, self.rows_total = b, w, d, p
        self.rectangular = p == b * w
        self.device_allocation = shape.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT
        if self.device_allocation and p < b:
            raise ValueError(f"{shape.label()}: device allocation needs P >= B")
        dev = state.pending_token.device
        i64, f32 = torch.int64, torch.float32
        self.input_block = InputBlock(self._input_layout(shape), device=str(dev),
                                  defaults=self._input_defaults(state))
        """The per-frame host inputs: one block, staged off the stream, one upload."""
        self.lane_rows = self.input_block.views["lane_rows"]
        self.lane_limit = self.input_block.views["lane_limit"]
        top = min(TOP_LOGPROBS, decoder.config.vocab_size)
        self.out_tokens = torch.full((b, w), PAD_TOKEN, dtype=i64, device=dev)
        self.out_logprobs = torch.zeros((b, w), dtype=f32, device=dev)
        self.out_top_token = torch.zeros((b, w, top), dtype=i64, device=dev)
        self.out_top_logprob = torch.zeros((b, w, top), dtype=f32, device=dev)
        self.out_finite = torch.zeros(b, dtype=torch.bool, device=dev)
        self.out_counts = torch.zeros((4, b), dtype=i64, device=dev)  # acc, eval, rows, proposed
        self.out_survival = torch.zeros((b, d), dtype=f32, device=dev)
        self.out_confidence = torch.zeros((2, b, d), dtype=f32, device=dev)
        self.out_drafts = torch.full((b, d), PAD_TOKEN, dtype=i64, device=dev)
        self.out_proposal = torch.full((b,), -1, dtype=i64, device=dev)
        self.out_acceptance = torch.full((b,), -1.0, dtype=f32, device=dev)
        self.reports_proposal = source == LEARNED and d == 0 and not draft_state.lagging
        """A width-one learned round feeds the draft each lane's pending token (SPEC-5),
        so it reports the draft's argmax there: a depth-one counterfactual proposal, and
        for sampled lanes ``sum min(p, q)`` with the target's distribution
        (``out_acceptance``, ``LaneSample.draft_acceptance``)."""
        self._proposal_logits: torch.Tensor | None = None
        self.out_beyond = torch.full((b,), -1.0, dtype=f32, device=dev)
        """Learned rounds with ``D >= 1``: for a lane that verified all ``D`` drafts, the
        probability that a ``(D + 1)``-th draft would have been accepted at the target's
        row ``D`` (``SpeculativeLane.beyond``); -1 elsewhere."""
        self._beyond_logits: torch.Tensor | None = None
        self.reports_beyond = source == LEARNED and d > 0
        self._bound: SpeculativeFrame | None = None
        self.execution = execution or ExecutionOptions.static()
        # host-known bounds chosen in bind (static options: the full row, always sample)
        self.context_blocks = cache.geometry.blocks_per_row
        """Blocks of each lane's table that target and draft attention gather."""
        self.any_sampled = True
        """False when every active lane is greedy and the shortcut is enabled: the round
        then verifies from argmax tokens (``verify_greedy``), the same result."""
        self.any_processing = True
        """False when no active lane has logit processing on (greedy shortcut only)."""
        self.caches_last_draft = True
        """False when no lane's limit reaches W: no lane can accept all D drafts, so the
        learned draft's last step (caching the last draft's KV) would write only the
        sink and is skipped (dynamic context only)."""
        self.catches_up = source == LEARNED and draft_state.lagging and d > 0
        """A lagging draft context (``gpu.draft_state``): the round re-feeds the draft
        the positions it missed before proposing, and advances ``draft_position``.
        Width-one rounds leave the draft alone then, like ordinary decodes."""
        self.draft_window = draft_state.catch_up + 1 if self.catches_up else 1
        """Rows per lane of the draft's first step: the pending token and up to
        ``catch_up`` missed positions before it (static options: all of them; eager
        ones: the power of two covering the bound lanes' largest lag)."""
        self._untraced_windows = bool(
            self.catches_up and draft_state.draft is not None
            and draft_state.draft.decoder.capture is not None and self.execution.host_bounds)
        """CPU forward capture: the first round traces the draft's first step at every
        window ``bind`` may choose, so none is traced mid-load (``_trace_windows``)."""
        index = torch.arange(b * w, device=dev)
        self._lane_major = (torch.div(index, w, rounding_mode="floor"), index % w,
                            torch.arange(b, device=dev) * w)
        """Rectangular layout: each packed row's lane and depth, each lane's offset."""
        # ragged programs attend per lane through a phase split (see _ragged_split)
        self._split_none = torch.full((1,), p, dtype=i64, device=dev)
        self._split_lane = torch.zeros(1, dtype=i64, device=dev)
        self._split_table = torch.full((1, 1), cache.geometry.sink_page, dtype=i64, device=dev)

    @staticmethod
    def _decode_rows(shape: GraphShape) -> int:
        """Packed target rows for speculative lanes (P); checks the shape's kind."""
        if shape.kind is not GraphKind.SPECULATIVE or shape.binding is None:
            raise ValueError("SpeculativeProgram runs GraphKind.SPECULATIVE shapes")
        p = shape.max_packed_extent
        if p < 1 or p > shape.batch_capacity * shape.token_capacity:
            raise ValueError(f"{shape.label()}: need 1 <= P <= B * W")
        return p

    @property
    def shape(self) -> GraphShape:
        return self._shape

    # ------------------------------------------------------------------ bind

    def validate(self, frame: object) -> SpeculativeFrame:
        if not isinstance(frame, SpeculativeFrame):
            raise FrameError(f"{self._shape.label()} takes a SpeculativeFrame")
        rows, limits = frame.rows, frame.limits
        if len(rows) > self.batch:
            raise FrameError(f"{len(rows)} lanes exceed batch capacity {self.batch}")
        if len(limits) != len(rows):
            raise FrameError("a speculative frame needs one limit per row")
        if len(set(rows)) != len(rows):
            raise FrameError("a row appears twice in one speculative frame")
        for row in rows:
            if not 0 <= row < self._state.rows:
                raise FrameError(f"state row {row} outside 0..{self._state.rows - 1}")
        if any(not 1 <= limit <= self.width for limit in limits):
            raise FrameError(f"lane limits must lie in 1..W={self.width}")
        if not self.device_allocation and sum(limits) > self.rows_total:
            raise FrameError(f"query lengths sum {sum(limits)} exceeds P={self.rows_total}")
        return frame

    def _input_layout(self, shape: GraphShape) -> list[tuple[str, torch.dtype, int]]:
        """The per-frame host inputs: each lane's state row and limit."""
        b = shape.batch_capacity
        return [("lane_rows", torch.int64, b), ("lane_limit", torch.int64, b)]

    def _input_defaults(self, state: RequestState) -> dict[str, int | bool]:
        """Unbound inputs: every lane on the sink row, limit 0 (idle)."""
        return {"lane_rows": state.sink_row}

    def stage(self, inputs: Mapping[str, Any]) -> StagedRound:
        """Validate a frame and pack it into a fresh host block; touches no device or
        shared state, so a backend may call it at launch, off the stream, while earlier
        frames still run (``bind_staged`` then only applies updates and uploads it)."""
        frame = self.validate(inputs.get(FRAME_KEY))
        self._state.validate_updates(frame.updates)
        block = self.input_block.host_block()
        host = self.input_block.host_views(block)
        lanes = len(frame.rows)
        host["lane_rows"][:lanes] = frame.rows
        host["lane_limit"][:lanes] = frame.limits
        return StagedRound(program=self, frame=frame, updates=frame.updates, block=block,
                           rows=frame.rows, limits=frame.limits)

    def bind(self, inputs: Mapping[str, Any]) -> None:
        self.bind_staged(self.stage(inputs))

    def bind_staged(self, staged: StagedRound) -> None:
        """Apply a staged frame's state updates, upload its host block in one copy and
        choose the host bounds (in stream order, right before ``execute``)."""
        if staged.program is not self:
            raise FrameError(f"frame staged for {staged.program.shape.label()}, "
                             f"bound to {self._shape.label()}")
        self._state.apply_updates(staged.updates)
        self.input_block.upload(staged.block)
        self._choose_bounds(staged.rows, staged.limits, extra_end=staged.extra_end)
        self._bound_frame(staged.frame)

    def _bound_frame(self, frame: Any) -> None:
        self._bound = frame

    def _choose_bounds(self, rows: Sequence[int], limits: Sequence[int], *,
                       extra_end: int = 0) -> None:
        """Host-known bounds for the next ``execute`` (eager execution options only; see
        ``gpu.programs.execution``). ``bind`` runs in stream order right before
        ``execute``, so the rows' positions and temperatures read here (after this
        frame's updates) are the ones ``execute`` sees.

        - dynamic context: every key a round reads lies below ``position + W`` (target
          rows reach ``position + limit - 1``; draft step ``j <= D`` attends up to
          ``position + j``), so attention gathers the power-of-two block count covering
          the largest such end (and ``extra_end``, a prompt chunk's end);
        - greedy shortcut: whether any active lane samples stochastically.
        """
        opts, st = self.execution, self._state
        if not opts.host_bounds:
            return
        active = [r for r, n in zip(rows, limits, strict=True) if n > 0]
        host = st.host_views  # CPU: read through numpy views, no tensor round trip
        if self.catches_up:
            self.draft_window = self._window_for(
                host["position"][active] - host["draft_position"][active] if host is not None
                else _gather_to_host(st.position, active)
                - _gather_to_host(st.draft_position, active))
        if opts.dynamic_context:
            self.caches_last_draft = max(limits, default=0) >= self.width
            geo = self._cache.geometry
            positions = (host["position"][active] if host is not None
                         else _gather_to_host(st.position, active)).tolist()
            end = max(max(positions) + self.width if active else 0, extra_end)
            self.context_blocks = context_blocks(
                min(end, geo.max_context), page_size=geo.page_size,
                blocks_per_row=geo.blocks_per_row)
        if opts.greedy_shortcut:
            temperature = (host["temperature"][active] if host is not None
                           else _gather_to_host(st.temperature, active)).tolist()
            # filtered_probs' greedy test is ``temperature <= 0``; NaN counts as sampled
            self.any_sampled = any(not t <= 0.0 for t in temperature)
            self.any_processing = st.any_processing(active)

    def _window_for(self, lags: np.ndarray) -> int:
        """The catch-up window for lanes lagging ``lags`` positions: the power of two
        covering the largest lag plus the pending token, at most ``catch_up + 1`` (the
        window is a dimension of the draft's graph, so it takes few values)."""
        need = int(lags.max()) + 1 if lags.size else 1
        return covering_power_of_two(need, self._draft.catch_up + 1)


    # ---------------------------------------------------------- read outputs

    def read_outputs(self) -> dict[str, Any]:
        """Copies of the output buffers (the next launch overwrites them); the lanes'
        Python objects are built later, off the stream (``SpeculativeReadout``)."""
        frame = self._bound
        if frame is None:
            raise FrameError("read_outputs before bind")
        return {RESULT_KEY: SpeculativeReadout(
            rows=tuple(frame.rows), tokens=_copied(self.out_tokens),
            logprobs=_copied(self.out_logprobs), top_ids=_copied(self.out_top_token),
            top_logprobs=_copied(self.out_top_logprob), finite=_copied(self.out_finite),
            counts=_copied(self.out_counts), survival=_copied(self.out_survival),
            drafts=_copied(self.out_drafts), confidence=_copied(self.out_confidence),
            proposals=_copied(self.out_proposal) if self.reports_proposal else None,
            acceptances=_copied(self.out_acceptance)
            if self.reports_proposal and self.any_sampled else None,
            beyond=_copied(self.out_beyond) if self.reports_beyond else None)}


def _copied(values: torch.Tensor) -> np.ndarray:
    """A host copy of an output buffer (on the CPU ``numpy()`` would share its memory)."""
    return values.cpu().numpy().copy()


def _gather_to_host(values: torch.Tensor, rows: list[int]) -> np.ndarray:
    """``values[rows]`` copied to a host array (a device round trip)."""
    index = torch.as_tensor(rows, dtype=torch.int64, device=values.device)
    return values.index_select(0, index).cpu().numpy()

