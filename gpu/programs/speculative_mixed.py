"""Wider speculative mixed programs: one prompt chunk alongside speculative decode lanes
(seed: *Mixed execution contract*, MIX-6, MIX-43; *Speculative graph coverage*).

A ``speculation_enabled`` mixed shape ``(B, W, C)`` with ``W > 1`` packs a prompt chunk
of up to ``C`` tokens and the speculative decode lanes' rows into ``P = C + (B - 1) * W``
rows of one target forward (MIX-33), at prefix-sum offsets (MIX-12): the chunk's rows
first, then each decode lane's. The decode lanes run exactly the complete speculative
round of ``SpeculativeProgram`` with host query lengths (chunk plus lengths fit P, so a
decode-only frame may run all B lanes at full width, MIX-17); the
prompt lane writes its chunk's KV into the target and the draft (draft-state
maintenance) and records it in the history, and a chunk that ends the prompt samples
the request's first token with the ordinary sampler. Idle lanes and padding rows write
only the sink. ``execute`` stays capturable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from gpu.frames import (
    FRAME_KEY,
    NO_PROMPT_ROW,
    RESULT_KEY,
    FrameError,
    LaneSample,
)
from gpu.model.batch import PackedBatch, PhaseSplit
from gpu.programs.speculative import SpeculativeProgram
from gpu.programs.speculative_binding import StagedRound
from gpu.programs.speculative_frames import (
    SpeculativeFrame,
    SpeculativeMixedFrame,
    SpeculativeMixedResult,
    SpeculativeResult,
    speculative_result_of,
)
from gpu.request_state import RequestState
from gpu.sampling import sample
from gpu.speculative import PackedLayout
from policy.descriptors import GraphKind, GraphShape


class SpeculativeMixedProgram(SpeculativeProgram):
    """A prepared wider speculative mixed program of one ``GraphShape``."""

    @staticmethod
    def _decode_rows(shape: GraphShape) -> int:
        if shape.kind is not GraphKind.MIXED or not shape.speculation_enabled \
                or shape.token_capacity < 2:
            raise ValueError("SpeculativeMixedProgram runs speculation_enabled mixed shapes "
                             "with W > 1")
        return shape.max_packed_extent  # C + (B - 1) * W, shared with the prompt chunk

    def __init__(self, shape: GraphShape, **kwargs: Any) -> None:
        super().__init__(shape, **kwargs)
        self.rectangular = False
        st = self._state
        dev = st.pending_token.device
        self.chunk = shape.prefill_capacity
        views = self.input_block.views  # the prompt chunk's inputs share the lanes' block
        self.prompt_row = views["prompt_row"]
        self.prompt_lane = views["prompt_lane"]
        self.prompt_tokens = views["prompt_tokens"]
        self.prompt_positions = views["prompt_positions"]
        self.prompt_valid = views["prompt_valid"]
        self.prompt_ends = views["prompt_ends"]
        self.prompt_end_position = views["prompt_end_position"]
        self.out_prompt_token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.out_prompt_logprob = torch.zeros(1, dtype=torch.float32, device=dev)
        self.out_prompt_finite = torch.zeros(1, dtype=torch.bool, device=dev)
        top = self.out_top_token.shape[2]
        self.out_prompt_top_token = torch.zeros((1, top), dtype=torch.int64, device=dev)
        self.out_prompt_top_logprob = torch.zeros((1, top), dtype=torch.float32, device=dev)
        self._prompt_hidden: torch.Tensor | None = None
        self._mixed_frame: SpeculativeMixedFrame | None = None

    # ------------------------------------------------------------------ bind

    def _input_layout(self, shape: GraphShape) -> list[tuple[str, torch.dtype, int]]:
        """The lanes' inputs plus the prompt chunk's (int64 first, then bool)."""
        c, i64 = shape.prefill_capacity, torch.int64
        return [
            *super()._input_layout(shape), ("prompt_row", i64, 1), ("prompt_lane", i64, 1), ("prompt_tokens", i64, c),
            ("prompt_positions", i64, c), ("prompt_end_position", i64, 1),
            ("prompt_valid", torch.bool, c), ("prompt_ends", torch.bool, 1)]

    def _input_defaults(self, state: RequestState) -> dict[str, int | bool]:
        return {**super()._input_defaults(state), "prompt_row": state.sink_row}

    def stage(self, inputs: Mapping[str, Any]) -> StagedRound:
        frame = self._validate_mixed(inputs.get(FRAME_KEY))
        has_prompt = frame.prefill_row != NO_PROMPT_ROW
        self._state.validate_updates(frame.updates)
        block = self.input_block.host_block()
        host = self.input_block.host_views(block)
        lanes, count = len(frame.rows), len(frame.prompt_tokens)
        host["lane_rows"][:lanes] = frame.rows
        host["lane_limit"][:lanes] = frame.limits
        host["prompt_tokens"][:count] = frame.prompt_tokens
        host["prompt_positions"][:] = np.arange(self.chunk, dtype=np.int64) + frame.prompt_start
        host["prompt_valid"][:count] = True
        lane = frame.prefill_row if has_prompt else 0
        host["prompt_lane"][0] = lane
        host["prompt_row"][0] = frame.rows[lane] if has_prompt else self._state.sink_row
        host["prompt_ends"][0] = has_prompt and frame.prompt_ends
        host["prompt_end_position"][0] = frame.prompt_start + count
        return StagedRound(program=self, frame=frame, updates=frame.updates, block=block,
                           rows=frame.rows, limits=frame.limits,
                           extra_end=frame.prompt_start + count if has_prompt else 0)

    def _bound_frame(self, frame: Any) -> None:
        self._bound = SpeculativeFrame(rows=frame.rows, limits=frame.limits)
        self._mixed_frame = frame

    def _validate_mixed(self, frame: object) -> SpeculativeMixedFrame:
        if not isinstance(frame, SpeculativeMixedFrame):
            raise FrameError(f"{self._shape.label()} takes a SpeculativeMixedFrame")
        rows, limits = frame.rows, frame.limits
        if len(rows) > self.batch or len(limits) != len(rows):
            raise FrameError(f"need at most B={self.batch} rows with one limit each")
        if len(set(rows)) != len(rows) or any(not 0 <= r < self._state.rows for r in rows):
            raise FrameError("rows must be distinct state rows")
        has_prompt = frame.prefill_row != NO_PROMPT_ROW
        if has_prompt:
            if not 0 <= frame.prefill_row < len(rows):
                raise FrameError("prefill_row must index the frame's rows")
            if not frame.prompt_tokens or limits[frame.prefill_row] != 0:
                raise FrameError("the prompt lane carries a non-empty chunk and limit 0")
        elif frame.prompt_tokens:
            raise FrameError("prompt tokens need a prompt row")
        if len(frame.prompt_tokens) > self.chunk:
            raise FrameError(f"{len(frame.prompt_tokens)} prompt tokens exceed C={self.chunk}")
        if frame.prompt_start < 0 or frame.prompt_start + len(frame.prompt_tokens) > \
                self._state.geometry.max_context:
            raise FrameError("the prompt chunk lies outside the context")
        decode = [x for i, x in enumerate(limits) if i != frame.prefill_row]
        if any(not 1 <= x <= self.width for x in decode):
            raise FrameError(f"decode lane limits must lie in 1..W={self.width}")
        if sum(decode) + len(frame.prompt_tokens) > self.rows_total:
            raise FrameError(f"{len(frame.prompt_tokens)} prompt tokens and decode lengths "
                             f"{sum(decode)} exceed P={self.rows_total}")
        return frame

    # --------------------------------------------------------------- execute

    def _prompt_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._state.block_table[self.prompt_row].expand(self.chunk, -1)
        return self._slots(table, self.prompt_positions, self.prompt_valid)

    def _target_forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                        lane: torch.Tensor, tables: torch.Tensor, layout: PackedLayout,
                        lengths: torch.Tensor) -> torch.Tensor:
        # Packed offsets are prefix sums (MIX-12): the chunk's ``count`` rows first, then
        # the decode lanes' rows (``ids`` etc. are laid out from 0 in decode order; decode
        # rows past ``P - count`` are unused because lengths + count <= P).
        prompt_slots, prompt_pos = self._prompt_slots()
        count = self.prompt_valid.sum()
        total = self.rows_total
        row = torch.arange(total, device=ids.device)
        is_prompt = row < count
        prompt_index = row.clamp(max=self.chunk - 1)
        decode_index = (row - count).clamp(min=0)
        # attention per phase (MIX-33 shares everything else): the prompt rows on the
        # prompt lane's keys, each decode lane's rows as one [W] query block on its own
        j = torch.arange(self.width, device=ids.device)[None, :]
        decode_slots = torch.where(j < lengths[:, None],
                                   count + layout.lane_offset[:, None] + j, total)
        split = PhaseSplit(
            prompt_slots=torch.where(self.prompt_valid, row[:self.chunk], total),
            prompt_lane=self.prompt_lane, decode_slots=decode_slots.reshape(-1),
            width=self.width)
        hidden = self._decoder.forward(PackedBatch(
            token_ids=torch.where(is_prompt, self.prompt_tokens[prompt_index], ids[decode_index]),
            positions=torch.where(is_prompt, prompt_pos[prompt_index], pos[decode_index]),
            write_slots=torch.where(is_prompt, prompt_slots[prompt_index], slots[decode_index]),
            token_lane=torch.where(is_prompt, self.prompt_lane, lane[decode_index]),
            lane_block_tables=tables, phase_split=split,
        ), self._cache)
        self._prompt_hidden = hidden[prompt_index]
        return hidden[(row + count).clamp(max=total - 1)]

    def execute(self) -> None:
        st, ds = self._state, self._draft
        # draft-state maintenance for the prompt chunk (history and draft KV)
        prompt_rows = self.prompt_row.expand(self.chunk)
        ds.record(prompt_rows, self.prompt_positions, self.prompt_tokens, self.prompt_valid)
        if ds.draft is not None:
            slots, pos = self._prompt_slots()
            ds.draft_forward(PackedBatch(
                token_ids=self.prompt_tokens, positions=pos, write_slots=slots,
                token_lane=torch.zeros_like(pos),
                lane_block_tables=st.block_table[self.prompt_row][:, :self.context_blocks],
            ))
            if ds.lagging:
                ds.advance_draft_position(self.prompt_row, torch.zeros_like(pos), pos,
                                          self.prompt_valid)
        super().execute()  # decode lanes: the complete round, sharing the target forward
        # the prompt lane's commit: position, and the first token when the prompt ends
        assert self._prompt_hidden is not None
        last = (self.prompt_valid.sum() - 1).clamp(min=0).view(1)  # stays on the device
        logits = self._decoder.logits(self._prompt_hidden.index_select(0, last))
        row = self.prompt_row
        token, logprob, finite, top_id, top_lp = sample(
            logits, temperature=st.temperature[row], top_p=st.top_p[row], top_k=st.top_k[row],
            seed=st.seed[row], position=self.prompt_end_position,
            top_width=self.out_prompt_top_token.shape[1], processing=st.processing(row),
            processed_logprobs=self.execution.processed_logprobs)
        st.record_outputs(row, token[:, None], self.prompt_ends.view(1, 1))
        self.out_prompt_token.copy_(token)
        self.out_prompt_logprob.copy_(logprob)
        self.out_prompt_finite.copy_(finite)
        self.out_prompt_top_token.copy_(top_id)
        self.out_prompt_top_logprob.copy_(top_lp)
        ends = self.prompt_ends
        st.pending_token.index_copy_(0, row, torch.where(ends, token, st.pending_token[row]))
        st.position.index_copy_(0, row, self.prompt_end_position)
        ds.record(row, self.prompt_end_position, token, ends)

    # ---------------------------------------------------------- read outputs

    def read_outputs(self) -> dict[str, Any]:
        frame = self._mixed_frame
        if frame is None:
            raise FrameError("read_outputs before bind")
        every = speculative_result_of(super().read_outputs())
        prompt_row = frame.rows[frame.prefill_row] if frame.prefill_row != NO_PROMPT_ROW else -1
        speculative = SpeculativeResult(
            lanes=tuple(lane for lane in every.lanes if lane.row != prompt_row),
            confidence=every.confidence, survival=every.survival)
        prompt_sample = None
        if prompt_row >= 0 and frame.prompt_ends:
            prompt_sample = LaneSample(
                row=prompt_row, token=int(self.out_prompt_token.cpu()[0]),
                logprob=float(self.out_prompt_logprob.cpu()[0]),
                finite=bool(self.out_prompt_finite.cpu()[0]),
                top_logprobs=tuple(zip(self.out_prompt_top_token.cpu()[0].tolist(),
                                       self.out_prompt_top_logprob.cpu()[0].tolist(),
                                       strict=True)))
        return {RESULT_KEY: SpeculativeMixedResult(speculative=speculative,
                                                   prompt_sample=prompt_sample)}
