"""Draft-side device state for speculative programs (seed: *Speculative graph coverage*).

Owns what a proposal source needs beyond the target's request state:

- the **learned draft**: a second ``Decoder`` (same tokenizer and vocabulary as the
  target) with its own paged KV pool. The draft pool has the target's page geometry
  and is addressed through the *target's* block tables, so a state row's draft KV
  follows the target's positions exactly: draft KV exists for every position the
  target has cached, in the page with the same id in the draft pool. Rolling back a
  rejected suffix therefore needs no work: the row's position only advances by the
  emitted count, and positions past it are overwritten by later rounds (the same rule
  the target KV follows).
- the **token history** ``[rows + 1, max_context]`` for copy (n-gram) proposals: the
  token at each cached position plus the pending token at ``position``.

**Lagging draft context** (flare's extension of SPEC-5, ``catch_up > 0``): keeping the
draft current on every width-one step makes each decode of a learned load run the draft
too. With ``catch_up = K`` ordinary decode frames only record the history, and
``RequestState.draft_position[row]`` says below which position the row's draft KV is
current: prefill and mixed frames advance it over the positions they feed the draft
(when they continue it), and a learned round first re-feeds the draft the missed
positions from the history, at most ``K`` of them (``SpeculativeProgram``'s catch-up
window), then proposes as a maintained draft would. Output is exact whatever the draft
sees (verification decides), so a lag beyond ``K`` only lowers acceptance: the positions
older than the window are given up (the round sets ``draft_position`` to the new
position), and a row restored from a cached prefix trusts its pages' draft KV.

``DraftMaintainingStateOp`` wraps state operations the same way: a snapshot or
restore copies the history row and the draft pool's partial last page alongside the
target's (full pages are shared by id in both pools); a page copy copies draft pages too.

``DraftMaintainingProgram`` wraps the ordinary prefill / decode / mixed programs so
that every token they feed the target is also fed to the draft and recorded in the
history (SPEC-5, MIX-6: width-one execution keeps the draft context current so that
wider rounds can resume). Everything is capturable: fixed shapes, no host sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gpu.frames import RESULT_KEY
from gpu.model.batch import PackedBatch, PhaseSplit
from gpu.model.config import load_model_config
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import PagedKVCache
from gpu.model.weights import WeightSource, load_weights
from gpu.programs.state_ops import StateOpProgram
from gpu.programs.step import StagedFrame, StepProgram
from gpu.programs.step_body import packed_tokens
from gpu.programs.step_readout import StepReadout
from gpu.request_state import RequestState
from gpu.speculative.distributions import acceptance_probability, filtered_probs
from policy.descriptors import GraphKind, GraphShape, StateOp


class DraftModelError(ValueError):
    """Raised when a draft checkpoint cannot serve a target (vocabulary mismatch)."""


@dataclass(frozen=True, slots=True)
class DraftModel:
    """The learned draft: decoder plus its KV pool (target geometry)."""

    decoder: Decoder
    cache: PagedKVCache


class DraftState:
    """Draft model (optional) and token history for one target's request state."""

    def __init__(self, state: RequestState, draft: DraftModel | None, *, device: str,
                 catch_up: int = 0) -> None:
        if catch_up < 0:
            raise ValueError("the draft catch-up window must be >= 0")
        self.state = state
        self.draft = draft
        if draft is not None:
            state.page_pools.append(draft.cache)  # a page copy copies its draft KV too
        self.catch_up = catch_up if draft is not None else 0
        """Most missed positions a learned round re-feeds the draft (0: the draft
        context is maintained on every step, the seed's rule)."""
        geo = state.geometry
        self.history = torch.zeros((state.rows + 1, geo.max_context), dtype=torch.int64,
                                   device=device)

    # ----------------------------------------------------------------- writes

    def record(self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
               valid: torch.Tensor) -> None:
        """History: ``history[rows[i], positions[i]] = tokens[i]`` where ``valid``; other
        entries write the sink row (nobody reads it). All tensors are ``[N]``."""
        st = self.state
        capacity = self.history.shape[1]
        ok = valid & (positions >= 0) & (positions < capacity)
        row = torch.where(ok, rows, st.sink_row)
        col = torch.where(ok, positions, 0).clamp(0, capacity - 1)
        self.history.index_put_((row, col), torch.where(ok, tokens, 0))

    def record_pending(self, rows: torch.Tensor) -> None:
        """Record each row's pending token at its position (rows ``[R]``; sink allowed)."""
        st = self.state
        self.record(rows, st.position[rows], st.pending_token[rows], rows != st.sink_row)

    @property
    def lagging(self) -> bool:
        """Whether ordinary decodes skip the draft (a learned round catches up)."""
        return self.catch_up > 0

    def advance_draft_position(self, rows: torch.Tensor, token_lane: torch.Tensor,
                               positions: torch.Tensor, valid: torch.Tensor) -> None:
        """After a draft forward over ``positions [N]`` (token ``i`` in lane
        ``token_lane[i]``, lane ``r`` on state row ``rows[r]``): each lane whose fed
        positions start at or below its ``draft_position`` continues the current draft
        context, which then reaches past its last fed position. Lanes fed nothing, or
        fed past a gap, keep theirs (a later round's catch-up re-feeds the gap)."""
        dp = self.state.draft_position
        lanes = rows.shape[0]
        beyond = self.state.geometry.max_context + 1
        start = torch.full((lanes,), beyond, dtype=torch.int64, device=rows.device)
        start.scatter_reduce_(0, token_lane, torch.where(valid, positions, beyond), "amin")
        end = torch.zeros(lanes, dtype=torch.int64, device=rows.device)
        end.scatter_reduce_(0, token_lane, torch.where(valid, positions + 1, 0), "amax")
        current = dp[rows]
        dp.index_copy_(0, rows, torch.where((start <= current) & (end > current), end, current))

    def draft_forward(self, batch: PackedBatch) -> torch.Tensor | None:
        """Run the draft over ``batch`` (writes draft KV); final hidden states or None."""
        if self.draft is None:
            return None
        return self.draft.decoder.forward(batch, self.draft.cache)


def load_draft_model(model_dir: str | Path, *, target: Decoder, target_cache: PagedKVCache
                     ) -> DraftModel:
    """Load a draft checkpoint for ``target`` (same vocabulary, target page geometry)."""
    directory = Path(model_dir)
    config = load_model_config(directory)
    if config.vocab_size != target.config.vocab_size:
        raise DraftModelError(
            f"draft vocabulary {config.vocab_size} differs from the target's "
            f"{target.config.vocab_size}")
    geometry = target_cache.geometry
    # placeholders (meta) where the target's are: tensor-parallel ranks load their shards
    model_device = "meta" if target.embed.is_meta else target.device
    weights = load_weights(directory, config, device=model_device, dtype=target.dtype)
    decoder = Decoder(config, weights, max_context=geometry.max_context, device=target.device,
                      dtype=target.dtype)
    decoder.source = WeightSource(directory, role="draft")
    if target.capture is not None:  # the draft forward is captured like the target's
        decoder.enable_capture()
    cache = PagedKVCache(config, geometry, device=model_device, dtype=target.dtype)
    return DraftModel(decoder=decoder, cache=cache)


class DraftMaintainingProgram:
    """An ordinary prefill / decode / mixed program that also keeps draft state current.

    ``execute`` feeds the draft exactly the tokens the wrapped program feeds the target
    (same positions and KV slots, in the draft's pool), records them in the history,
    runs the wrapped program, then records each lane's new pending token. With a
    lagging draft context an ordinary decode only records (no draft forward), and the
    other kinds advance ``draft_position`` over what they fed.
    """

    def __init__(self, inner: StepProgram, draft_state: DraftState) -> None:
        if inner.shape.kind not in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL,
                                    GraphKind.DECODE, GraphKind.MIXED):
            raise ValueError(f"cannot maintain draft state around {inner.shape.label()}")
        self.inner = inner
        self.draft_state = draft_state
        self._lane_major = inner.shape.token_capacity if inner.shape.kind is GraphKind.DECODE \
            else 0
        self._feeds_draft = draft_state.draft is not None and not (
            draft_state.lagging and inner.shape.kind is GraphKind.DECODE)
        """Whether this program runs the draft (a lagging context skips it in decodes)."""
        self._proposes = self._feeds_draft and inner.shape.kind is GraphKind.DECODE
        """A maintained decode feeds the draft each lane's pending token, so the draft's
        argmax there is the depth-one greedy proposal a round would have verified: it
        is reported per lane (``LaneSample.draft_proposal``)."""
        self.out_proposal = torch.full((inner.shape.batch_capacity,), -1, dtype=torch.int64,
                                       device=draft_state.history.device)
        self.out_acceptance = torch.full((inner.shape.batch_capacity,), -1.0,
                                         dtype=torch.float32, device=draft_state.history.device)
        """Per lane, ``sum min(p, q)`` of the target's and the draft's filtered
        distributions (``LaneSample.draft_acceptance``); -1 for greedy-only steps."""
        self._draft_logits: torch.Tensor | None = None

    @property
    def shape(self) -> GraphShape:
        return self.inner.shape

    @property
    def holds_grammars(self) -> bool:
        """The wrapped program's capability (``StepProgram.holds_grammars``): its frames
        reach the wrapped program whole, resident grammar rows included."""
        return self.inner.holds_grammars

    def bind(self, inputs: Mapping[str, Any]) -> None:
        self.inner.bind(inputs)

    def stage(self, inputs: Mapping[str, Any]) -> StagedFrame:
        """The wrapped program's staging (a backend stages launches through it)."""
        return self.inner.stage(inputs)

    def bind_staged(self, staged: StagedFrame) -> None:
        self.inner.bind_staged(staged)

    def execute(self) -> None:
        if not self._feeds_draft and self.inner.shape.kind is GraphKind.DECODE:
            # a decode feeds each lane its pending token at its position, which whoever
            # produced that token recorded already: only the new pending tokens remain
            self.inner.execute()
            self.draft_state.record_pending(self.inner.buffers.lane_rows)
            return
        b, st, ds = self.inner.buffers, self.draft_state.state, self.draft_state
        rows = b.lane_rows
        tok_row, pos, ids, _, valid, slots = packed_tokens(
            b, st.position, st.pending_token, st.block_table, st.geometry)
        ds.record(tok_row, pos, ids, valid)
        if self._feeds_draft:
            hidden = ds.draft_forward(PackedBatch(
                token_ids=ids, positions=pos, write_slots=slots, token_lane=b.token_lane,
                lane_block_tables=st.block_table[:, :self.inner.context_blocks].index_select(
                    0, rows),
                lane_major_width=self._lane_major, phase_split=self._phase_split(rows),
            ))
            if ds.lagging:
                ds.advance_draft_position(rows, b.token_lane, pos, valid)
            if self._proposes and hidden is not None and ds.draft is not None:
                # decode: token i is lane i's pending token (lane-major, width one)
                self._draft_logits = ds.draft.decoder.logits(hidden)
                self.out_proposal.copy_(self._draft_logits.argmax(dim=-1))
        self.inner.execute()
        ds.record_pending(rows)
        if self._proposes and self._draft_logits is not None:
            self._draft_acceptance(rows)

    def _draft_acceptance(self, rows: torch.Tensor) -> None:
        """Each lane's depth-one acceptance probability ``sum min(p, q)`` under its own
        sampling parameters, when any lane samples (greedy-only steps keep -1: their
        greedy proposal decides the counterfactual exactly). A decode's lanes all
        sample, in lane order, so the target's lane logits align with the draft's."""
        inner, target, draft = self.inner, self.inner.lane_logits, self._draft_logits
        self._draft_logits = None
        if not inner.any_sampled or target is None or draft is None \
                or target.shape != draft.shape:
            self.out_acceptance.fill_(-1.0)
            return
        st = self.draft_state.state
        params = {"temperature": st.temperature[rows], "top_p": st.top_p[rows],
                  "top_k": st.top_k[rows]}
        self.out_acceptance.copy_(acceptance_probability(filtered_probs(target, **params),
                                                         filtered_probs(draft, **params)))

    def _phase_split(self, rows: torch.Tensor) -> PhaseSplit | None:
        """Mixed frames: the draft attends per phase exactly as the target does (the
        prompt chunk on its lane's keys, each decode lane on its own), over the same
        host-chosen context the wrapped program read."""
        inner = self.inner
        if inner.shape.kind is not GraphKind.MIXED:
            return None
        b, st = inner.buffers, self.draft_state.state
        table = None
        if inner.execution.dynamic_context:
            table = st.block_table[:, :inner.prompt_blocks].index_select(
                0, rows.index_select(0, b.prompt_lane))
        return PhaseSplit(prompt_slots=b.prompt_slots, prompt_lane=b.prompt_lane,
                          decode_slots=b.decode_slots, width=inner.shape.token_capacity,
                          prompt_block_table=table)

    def read_outputs(self) -> dict[str, Any]:
        outputs = self.inner.read_outputs()
        readout = outputs.get(RESULT_KEY)
        if self._proposes and isinstance(readout, StepReadout):
            lanes = len(readout.rows)  # a decode's lanes all sample, in lane order
            acceptances = self.out_acceptance[:lanes].cpu().numpy().copy()
            outputs = {**outputs, RESULT_KEY: replace(
                readout, draft_proposals=self.out_proposal[:lanes].cpu().numpy().copy(),
                draft_acceptances=acceptances if (acceptances >= 0.0).any() else None)}
        return outputs


class DraftMaintainingStateOp:
    """A state operation that also copies draft state (history rows, draft pages)."""

    def __init__(self, inner: StateOpProgram, draft_state: DraftState) -> None:
        self.inner = inner
        self.draft_state = draft_state

    @property
    def shape(self) -> GraphShape:
        return self.inner.shape

    def bind(self, inputs: Mapping[str, Any]) -> None:
        self.inner.bind(inputs)

    def execute(self) -> None:
        op, ds, inner = self.inner.op, self.draft_state, self.inner
        draft = ds.draft
        if op in (StateOp.SNAPSHOT, StateOp.RESTORE):
            st = ds.state
            geo = st.geometry
            src, dst, dpage = inner.src_row, inner.dst_row, inner.dst_page
            ds.history.index_copy_(0, dst, ds.history[src])
            if draft is not None:
                # the same partial-page rule as the target's copy (StateOpProgram)
                pos = st.position[src]
                block = torch.div(pos, geo.page_size, rounding_mode="floor").clamp(
                    max=geo.blocks_per_row - 1)
                has_partial = (pos % geo.page_size != 0) & (dpage >= 0)
                src_page = st.block_table[src].gather(1, block[:, None]).squeeze(1)
                sink = torch.full_like(dpage, geo.sink_page)
                draft.cache.copy_pages(torch.where(has_partial, src_page, sink),
                                       torch.where(has_partial, dpage, sink))
        elif op is StateOp.PAGE_COPY and draft is not None:
            draft.cache.copy_pages(inner.page_src, inner.page_dst)
        inner.execute()

    def read_outputs(self) -> dict[str, Any]:
        return self.inner.read_outputs()
