"""The tensor body of a packed step program's ``execute``: one function of the
program's buffers, the request state it reads and the host constants ``bind`` chose.

``run_step`` gathers the packed tokens and positions, runs the shared forward, projects
each lane's sampled token to the vocabulary, samples, and writes the per-lane outputs
into the program's output buffers; it returns the new pending tokens and positions of
the frame's lanes, which the caller commits (``commit``). Everything it writes (K/V at
the frame's slots, the output buffers) is a pure function of what it reads, so running
it twice leaves the same state: that is what lets a CPU program trace it once into a
graph (``gpu.model.capture.ForwardCapture.replay``) and replay it, the whole step
without the interpreter, with the same aten operations in the same order as the
op-by-op run (bit-identical outputs). ``StepConfig`` holds every host value the body
branches on, so it is part of a traced graph's key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from gpu.model.batch import PackedBatch, PhaseSplit
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import CacheGeometry, PagedKVCache
from gpu.programs.workspace import PackedBuffers
from gpu.sampling import (
    RowProcessing,
    reads_parameters,
    reported_log_probs,
    sample,
    top_alternatives,
)

_BUFFER_FIELDS = tuple(f.name for f in fields(PackedBuffers))

STEP_SOURCES = ("gpu.programs.step_body", "gpu.programs.workspace", "gpu.sampling",
                "gpu.grammar_mask")
"""The modules a traced step runs beyond ``gpu.model`` (part of its graph key)."""


@dataclass(frozen=True, slots=True)
class StepConfig:
    """The host constants one ``run_step`` follows (a traced graph's key)."""

    scored: bool
    lane_major_width: int
    split_width: int
    """The mixed phase split's decode width; -1: no phase split."""
    greedy_only: bool
    top_width: int
    processed_logprobs: bool
    masked: bool
    """A token mask is applied (``StepState.token_mask`` is set)."""


class StepState(NamedTuple):
    """The request-state tensors a step reads (the caller slices the tables)."""

    position: torch.Tensor
    pending_token: torch.Tensor
    block_table: torch.Tensor
    context_table: torch.Tensor
    """``block_table[:, :context_blocks]``: the columns attention gathers."""
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    prompt_table: torch.Tensor | None = None
    """``block_table[:, :prompt_blocks]`` (mixed, dynamic context only)."""
    token_mask: torch.Tensor | None = None


class StepOutputs(NamedTuple):
    token: torch.Tensor
    new_pending: torch.Tensor
    new_position: torch.Tensor
    lane_logits: torch.Tensor


class PackedTokens(NamedTuple):
    """Each packed token's state row, position, id and K/V slot (``packed_tokens``)."""

    row: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    in_context: torch.Tensor
    valid: torch.Tensor
    slot: torch.Tensor


def packed_tokens(b: PackedBuffers, position: torch.Tensor, pending_token: torch.Tensor,
                  block_table: torch.Tensor, geo: CacheGeometry) -> PackedTokens:
    """Resolve the packed tokens against the request state: state-fed tokens take the
    row's position (plus the lane offset) and pending token, host-fed ones their own.
    A token past the context (a host bug) is invalid: it writes only the sink, and the
    step reports a non-finite sample for its lane, so the completion validator rejects
    it."""
    ps, nb = geo.page_size, geo.blocks_per_row
    row = b.lane_rows[b.token_lane]
    pos = torch.where(b.from_state, position[row] + b.lane_offset, b.host_position)
    ids = torch.where(b.from_state, pending_token[row], b.host_token)
    in_context = pos < geo.max_context
    valid = b.valid & in_context
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    block = torch.div(pos, ps, rounding_mode="floor").clamp(max=nb - 1)
    page = block_table[row].gather(1, block[:, None]).squeeze(1)
    slot_index = torch.arange(pos.shape[0], device=pos.device)
    sink_slot = geo.sink_page * ps + slot_index % ps
    slots = torch.where(valid, page * ps + pos % ps, sink_slot)
    return PackedTokens(row, pos, ids, in_context, valid, slots)


def run_step(decoder: Decoder, cache: PagedKVCache, b: PackedBuffers, st: StepState,
             config: StepConfig, *, split: PhaseSplit | None = None,
             image_features: tuple[torch.Tensor, torch.Tensor] | None = None,
             processing: RowProcessing | None = None) -> StepOutputs:
    """One step over the bound frame (module docstring); ``split`` carries the mixed
    phase layout (its tensors are ``b``'s), ``processing`` the lanes' logit processing
    (None: off)."""
    rows = b.lane_rows
    _, pos, ids, in_context, _, slots = packed_tokens(
        b, st.position, st.pending_token, st.block_table, cache.geometry)
    if split is not None and st.prompt_table is not None:
        prompt_row = rows.index_select(0, b.prompt_lane)
        split = PhaseSplit(prompt_slots=split.prompt_slots, prompt_lane=split.prompt_lane,
                           decode_slots=split.decode_slots, width=split.width,
                           prompt_block_table=st.prompt_table.index_select(0, prompt_row))
    batch = PackedBatch(
        token_ids=ids, positions=pos, write_slots=slots, token_lane=b.token_lane,
        lane_block_tables=st.context_table.index_select(0, rows),
        lane_major_width=config.lane_major_width, phase_split=split,
        image_features=image_features,
    )
    hidden = decoder.forward(batch, cache)

    if config.scored:
        all_logits = decoder.logits(hidden)
        log_probs = reported_log_probs(all_logits)
        scored = log_probs.gather(1, b.next_token.clamp(min=0)[:, None]).squeeze(1)
        b.out_prompt_logprobs.copy_(
            torch.where(b.next_token >= 0, scored, torch.full_like(scored, float("nan")))
        )
        top_id, top_lp = top_alternatives(log_probs, b.out_prompt_top_token.shape[1])
        b.out_prompt_top_token.copy_(top_id)
        b.out_prompt_top_logprob.copy_(top_lp)
        lane_logits = all_logits[b.sample_index]
    else:
        lane_logits = decoder.logits(hidden[b.sample_index])
    width = config.top_width
    params = reads_parameters(greedy_only=config.greedy_only,
                              processed_logprobs=config.processed_logprobs)
    token, logprob, finite, top_id, top_lp = sample(
        lane_logits,
        temperature=st.temperature[rows] if params else None,
        top_p=st.top_p[rows] if params else None, top_k=st.top_k[rows] if params else None,
        seed=st.seed[rows] if params else None,
        position=pos[b.sample_index] + 1 if params else None,
        greedy_only=config.greedy_only, top_width=width, processing=processing,
        token_mask=st.token_mask, processed_logprobs=config.processed_logprobs,
    )
    b.out_token.copy_(token)
    b.out_logprob.copy_(logprob)
    b.out_finite.copy_(finite & in_context[b.sample_index])
    if width:
        b.out_top_token[:, :width].copy_(top_id)
        b.out_top_logprob[:, :width].copy_(top_lp)
    new_pending = torch.where(b.commits_token, token, st.pending_token[rows])
    new_position = torch.where(
        b.absolute_position >= 0, b.absolute_position, st.position[rows] + b.advance
    )
    return StepOutputs(token, new_pending, new_position, lane_logits)


def step_tensors(b: PackedBuffers) -> list[torch.Tensor]:
    """The leading graph inputs of a traced ``run_step``: every buffer, in field order;
    the state's set tensors follow, in ``StepState`` order (``traced_step`` takes
    them back)."""
    return [getattr(b, name) for name in _BUFFER_FIELDS]


def traced_step(config: StepConfig, *, phase_split: bool, prompt_table: bool
                ) -> _TracedStep:
    """The function a capture traces: ``run_step`` over ``step_tensors`` of a frame
    whose layout ``config``, ``phase_split`` and ``prompt_table`` describe."""
    return _TracedStep(config, phase_split, prompt_table)


@dataclass(frozen=True, slots=True)
class _TracedStep:
    config: StepConfig
    phase_split: bool
    prompt_table: bool

    def __call__(self, decoder: Decoder, cache: PagedKVCache, *tensors: torch.Tensor
                 ) -> StepOutputs:
        count = len(_BUFFER_FIELDS)
        b = PackedBuffers(*tensors[:count])
        rest = list(tensors[count + 8:])
        prompt = rest.pop(0) if self.prompt_table else None
        mask = rest.pop(0) if self.config.masked else None
        st = StepState._make((*tensors[count:count + 8], prompt, mask))
        split = (PhaseSplit(prompt_slots=b.prompt_slots, prompt_lane=b.prompt_lane,
                            decode_slots=b.decode_slots, width=self.config.split_width)
                 if self.phase_split else None)
        return run_step(decoder, cache, b, st, self.config, split=split)
