"""Complete speculative programs, one per physical ``(B, D, W, P)`` (seed: *Speculative
graph coverage*, *Completed confidence and acceptance*).

One prepared execution (CAT-10) does the whole round for up to B lanes:

1. **proposal**: the learned draft (``D`` draft decoder steps from each lane's pending
   token, drafts drawn on the draft stream from the request's own sampling
   distribution, plus one step that caches the last draft's KV so a fully accepted
   round leaves the draft context complete) or copy (n-gram lookup in the lane's
   token history, SPEC-8/9);
2. **confidence** sidecar ``float32 [2, B, D]`` (ACC-10..12; learned: ``max q``, copy: 1
   per supplied token);
3. **target rows**: ``QueryLength`` takes host-fixed per-lane lengths (sum <= P);
   ``SpeculativePrefixLimit`` allocates inside the program from the host's immutable
   lane ceilings by joint prefix probability (SPEC-22..30; copy lanes are capped at
   ``min(ceiling, proposed + 1)``);
4. **verification**: one target forward over the packed lane rows (rectangular
   programs lane-major, ragged ones packed in slot order), then rejection sampling
   with ``verify_drafts`` (exact target law; greedy lanes get exactly the target's
   greedy tokens) and ``completion_speculative_survival`` (ACC-27);
5. **commit**: each active lane's pending token becomes the last emitted token and its
   position advances by the emitted count. Target and draft KV past the accepted
   prefix is simply overwritten later (rollback by position); the history records the
   emitted tokens.

Width-one programs (``D = 0``) feed the pending token to target and draft alike and
sample exactly what ordinary decoding samples, keeping the draft context current so
wider rounds can resume (SPEC-5). Idle lanes address the sink row and sink page and
mutate nothing. ``execute`` is capturable: fixed shapes, no host sync.

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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu.draft_state import (
    DraftMaintainingProgram,
    DraftMaintainingStateOp,
    DraftState,
    load_draft_model,
)
from gpu.engine import ModelEngine, UnsupportedShapeError
from gpu.frames import FRAME_KEY, RESULT_KEY, TOP_LOGPROBS, FrameError, StateUpdate
from gpu.kv_cache import PagedKVCache
from gpu.model.decoder import Decoder, PackedBatch, PhaseSplit
from gpu.programs.execution import ExecutionOptions, context_blocks, context_buckets
from gpu.programs.state_ops import StateOpProgram
from gpu.programs.step import StepProgram
from gpu.programs.workspace import InputBlock, Workspace
from gpu.request_state import RequestState
from gpu.speculative import (
    PAD_TOKEN,
    PackedLayout,
    acceptance_probability,
    allocate_target_rows,
    copy_confidence,
    draft_confidence,
    filtered_probs,
    filtered_probs_by_lane,
    greedy_tokens,
    packed_layout,
    pick_logprobs,
    propose_copy,
    sample_draft_tokens,
    target_log_probs,
    unpack_lane_rows,
    verify_drafts,
    verify_greedy,
    write_confidence_sidecar,
)
from gpu.speculative.copy_proposals import COPY_MAX_NGRAM
from policy.descriptors import GraphKind, GraphShape, TargetBinding

LEARNED = "draft"
COPY = "copy"
SOURCES = (LEARNED, COPY)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeFrame:
    """One speculative round for ``rows`` (lane ``i`` is ``rows[i]``).

    ``limits[i]`` is, for a ``QueryLength`` program, the lane's exact target rows
    (1..W: the pending token plus ``limits[i] - 1`` verified drafts; their sum fits P);
    for a ``SpeculativePrefixLimit`` program, the lane's immutable ceiling
    ``min(D + 1, W, request limit)`` (1..W; the sum may exceed P). The host reserves
    pages for positions ``position .. position + limits[i] - 1`` (in ``updates``)."""

    rows: tuple[int, ...]
    limits: tuple[int, ...]
    updates: tuple[StateUpdate, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeLane:
    """What one lane produced: ``tokens`` (accepted drafts then the correction or bonus
    token), their logprobs and top alternatives, whether the target rows were finite,
    the accepted and verified draft counts, the target rows it used, the drafts the
    source supplied (copy: the proposal length; learned: D), the survival products
    of its verified prefixes (ACC-27) and the drafted tokens themselves."""

    row: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    finite: bool
    accepted: int
    evaluated: int
    target_rows: int
    proposed: int
    survival: tuple[float, ...]
    drafts: tuple[int, ...] = ()
    """The proposal the round drew (``proposed`` tokens; none for idle lanes)."""
    draft_proposal: int = -1
    """Width-one learned rounds that keep the draft context: the draft's greedy
    proposal for the emitted token (``LaneSample.draft_proposal``); -1 otherwise."""
    draft_acceptance: float = -1.0
    """Such a round's sampled lanes: ``sum min(p, q)`` for the emitted token
    (``LaneSample.draft_acceptance``); -1 otherwise."""
    beyond: float = -1.0
    """Learned rounds with ``D >= 1``, lanes that verified all ``D`` drafts: the
    probability that the draft's next proposal would have been accepted at the target's
    row ``D`` along the drafted prefix (greedy: whether it equals the target's argmax
    there; sampled: ``sum min(p, q)`` over that row); -1 for other lanes. Reported
    whatever the lane accepted, so that observing depth ``D + 1`` does not depend on the
    outcome (the prefix's own survival multiplies it: ``policy.learning.round_observations``)."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SpeculativeResult:
    """Result of a speculative round: one entry per frame lane, and the sidecars over
    all B slots: ``confidence float32 [2, B, D]`` and ``survival float32 [B, D]``
    (``completion_speculative_survival``)."""

    lanes: tuple[SpeculativeLane, ...]
    confidence: np.ndarray
    survival: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class StagedRound:
    """A validated speculative frame packed into its own host block, ready for
    ``bind_staged``: the frame, its state updates, the block, and what the host bounds
    need (the lanes' rows and limits, and a prompt chunk's end for mixed frames)."""

    program: SpeculativeProgram
    frame: Any
    updates: tuple[StateUpdate, ...]
    block: np.ndarray
    rows: tuple[int, ...]
    limits: tuple[int, ...]
    extra_end: int = 0


class SpeculativeProgram:
    """A prepared complete speculative program of one ``GraphShape``."""

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

    def _window_for(self, lags: np.ndarray) -> int:
        """The catch-up window for lanes lagging ``lags`` positions: the power of two
        covering the largest lag plus the pending token, at most ``catch_up + 1`` (the
        same bucketing as context blocks, one "block" per position)."""
        need = int(lags.max()) + 1 if lags.size else 1
        return context_blocks(need, page_size=1, blocks_per_row=self._draft.catch_up + 1)

    def _trace_windows(self) -> None:
        """Trace the draft's first step at every catch-up window (each traces its
        context buckets too, ``gpu.model.capture``) on placeholder inputs that write
        only the sink page; tracing is preparation, left out of the launch's timing."""
        draft = self._draft.draft
        assert draft is not None
        self._untraced_windows = False
        geo = self._cache.geometry
        dev = self.lane_rows.device
        tables = torch.full((self.batch, 1), geo.sink_page, dtype=torch.int64, device=dev)
        for window in context_buckets(self._draft.catch_up + 1):
            n = self.batch * window
            zeros = torch.zeros(n, dtype=torch.int64, device=dev)
            draft.decoder.forward(PackedBatch(
                token_ids=zeros, positions=zeros,
                write_slots=geo.sink_page * geo.page_size + torch.arange(n, device=dev)
                % geo.page_size,
                token_lane=torch.arange(self.batch, device=dev).repeat_interleave(window),
                lane_block_tables=tables, lane_major_width=window,
            ), draft.cache)

    # --------------------------------------------------------------- execute

    def _slots(self, tables: torch.Tensor, pos: torch.Tensor, ok: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV slots for positions ``pos [N]`` in block tables ``[N, nb]`` (sink where not
        ``ok``) and the positions to use (0 where not ``ok``)."""
        geo = self._cache.geometry
        ps = geo.page_size
        ok = ok & (pos < geo.max_context) & (pos >= 0)
        safe = torch.where(ok, pos, 0)
        block = torch.div(safe, ps, rounding_mode="floor").clamp(max=geo.blocks_per_row - 1)
        page = tables.gather(1, block[:, None]).squeeze(1)
        index = torch.arange(pos.shape[0], device=pos.device)
        slots = torch.where(ok, page * ps + safe % ps, geo.sink_page * ps + index % ps)
        return slots, safe

    def _learned(self, rows: torch.Tensor, n: torch.Tensor, pending: torch.Tensor,
                 limit: torch.Tensor, params: dict[str, torch.Tensor], seed: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft D tokens per lane (writing draft KV for positions n .. n+D within the
        lane's limit). Returns drafts ``[B, D]``, their distributions (None when every
        lane is greedy: the drafts are then the draft's argmax tokens, what sampling
        from its one-hot rows draws) and confidences."""
        draft = self._draft.draft
        assert draft is not None
        greedy = not self.any_sampled
        b, steps = self.batch, self.depth + (1 if self.caches_last_draft else 0)
        if self._draft.lagging and self.depth == 0:
            steps = 0  # a width-one round leaves a lagging draft context alone
        if self._untraced_windows:
            self._trace_windows()
        tables = self._state.block_table[rows]
        attended = tables[:, :self.context_blocks]
        lane = torch.arange(b, device=rows.device)
        # every step's KV slots and positions at once (step j feeds position n + j)
        step = torch.arange(steps, device=rows.device)[None, :]
        step_pos = (n[:, None] + step).reshape(-1)
        step_slots, step_safe = self._slots(
            tables.repeat_interleave(steps, dim=0), step_pos,
            (step < limit[:, None]).reshape(-1))
        step_slots = step_slots.view(b, steps)
        step_pos = torch.where((limit > 0)[:, None], step_pos.view(b, steps),
                               step_safe.view(b, steps))
        token = pending
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        for j in range(steps):
            if j == 0 and self.draft_window > 1:
                hidden = self._catch_up(rows, n, limit, tables, attended)
            else:
                hidden = draft.decoder.forward(PackedBatch(
                    token_ids=token, positions=step_pos[:, j], write_slots=step_slots[:, j],
                    token_lane=lane, lane_block_tables=attended, lane_major_width=1,
                ), draft.cache)
            if j == self.depth:
                if self.reports_proposal:
                    self._proposal_logits = draft.decoder.logits(hidden)
                    self.out_proposal.copy_(
                        torch.where(limit > 0, greedy_tokens(self._proposal_logits), -1))
                elif self.depth > 0:  # the draft's next proposal after its last draft
                    self._beyond_logits = draft.decoder.logits(hidden)
                break  # this step only caches the last draft's KV (see caches_last_draft)
            logits = draft.decoder.logits(hidden)
            if greedy:
                token = greedy_tokens(logits)
            else:
                q = filtered_probs(logits, **params)
                token = sample_draft_tokens(q, seed, n + 1 + j, n)
                dists.append(q)
            drafts.append(token)
        if not drafts:
            empty = torch.zeros((self.batch, 0), dtype=torch.int64, device=rows.device)
            return empty, None, empty.float()
        tokens = torch.stack(drafts, dim=1)
        present = (limit > 0)[:, None].expand(-1, self.depth)
        if greedy:  # max q of a one-hot row is 1
            return tokens, None, present.to(torch.float32)
        probs = torch.stack(dists, dim=1)
        return tokens, probs, draft_confidence(probs, present)

    def _catch_up(self, rows: torch.Tensor, n: torch.Tensor, limit: torch.Tensor,
                  tables: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The draft's first step over a lagging context: each lane's window of
        ``draft_window`` positions ending at its pending token (position ``n``) is fed
        from the history, writing draft KV from the lane's ``draft_position`` on (the
        positions before it are current already); the pending token's hidden state per
        lane ``[B, hidden]``."""
        draft = self._draft.draft
        assert draft is not None
        b, window = self.batch, self.draft_window
        k = torch.arange(window, device=rows.device)[None, :]
        pos = n[:, None] - (window - 1) + k  # [B, window], the last column is n
        write = ((pos >= self._state.draft_position[rows][:, None]) | (k == window - 1)) \
            & (limit > 0)[:, None]
        slots, safe = self._slots(tables.repeat_interleave(window, dim=0), pos.reshape(-1),
                                  write.reshape(-1))
        ids = self._draft.history[rows[:, None].expand(b, window), safe.view(b, window)]
        hidden = draft.decoder.forward(PackedBatch(
            token_ids=ids.reshape(-1), positions=safe, write_slots=slots,
            token_lane=torch.arange(b, device=rows.device).repeat_interleave(window),
            lane_block_tables=attended, lane_major_width=window,
        ), draft.cache)
        return hidden.view(b, window, -1)[:, -1]

    def execute(self) -> None:
        st, ds = self._state, self._draft
        b, w, d, p = self.batch, self.width, self.depth, self.rows_total
        rows, limit = self.lane_rows, self.lane_limit
        active = limit > 0
        n, pending = st.position[rows], st.pending_token[rows]
        params = {"temperature": st.temperature[rows], "top_p": st.top_p[rows],
                  "top_k": st.top_k[rows]}
        seed = st.seed[rows]
        ds.record(rows, n, pending, active)
        # this round's draft logits for the counterfactuals, set by ``_learned``
        self._proposal_logits = self._beyond_logits = None
        if self.reports_beyond:
            self.out_beyond.fill_(-1.0)  # set again below where a lane qualifies

        # 1-2. proposals and their confidences
        draft_probs: torch.Tensor | None
        if self.source == LEARNED:
            drafts, draft_probs, confidence = self._learned(rows, n, pending, limit, params, seed)
            proposed = torch.where(active, d, 0)
            ceilings = limit
        elif d == 0:  # width one: nothing to propose
            drafts = torch.zeros((b, 0), dtype=torch.int64, device=rows.device)
            draft_probs, proposed, ceilings = None, torch.zeros_like(limit), limit
            confidence = drafts.float()
        else:
            # the history past every lane's context (n + 1 < context_blocks pages) can
            # never match or be proposed: the search reads only the attended columns
            columns = self.context_blocks * self._cache.geometry.page_size
            copy = propose_copy(ds.history[rows, :columns], torch.where(active, n + 1, 0),
                                depth=d, max_ngram=self.copy_max_ngram)
            proposed = torch.where(active, copy.proposed, 0)
            drafts = torch.where(active[:, None], copy.tokens, PAD_TOKEN)
            draft_probs = None
            confidence = copy_confidence(proposed, d)
            ceilings = torch.minimum(limit, proposed + 1)
        write_confidence_sidecar(self.out_confidence, confidence)

        # 3. target rows
        if not self.device_allocation:
            lengths = limit
        elif d == 0:
            lengths = ceilings.clamp(max=1)
        else:
            lengths = allocate_target_rows(self.out_confidence[1], ceilings, p)
        layout = self._layout(lengths)

        # 4. one target forward over the packed rows, then rejection sampling
        lane, depth = layout.row_lane, layout.row_depth
        padded = torch.cat([pending[:, None], drafts.clamp(min=0)], dim=1)  # [B, W]
        ids = padded[lane, depth]
        tables = st.block_table[rows]
        slots, pos = self._slots(tables[lane], n[lane] + depth, layout.row_used)
        hidden = self._target_forward(ids, pos, slots, lane, tables[:, :self.context_blocks],
                                      layout, lengths)
        logits = self._decoder.logits(hidden)
        lane_logits = logits.view(b, w, -1) if self.rectangular else \
            unpack_lane_rows(logits, layout, w)  # [B, W, V]
        if self.any_sampled:
            target_probs = filtered_probs_by_lane(lane_logits, **params)
            result = verify_drafts(draft_tokens=drafts, draft_probs=draft_probs,
                                   target_probs=target_probs, lengths=lengths, seed=seed,
                                   position=n + 1)
            if self._proposal_logits is not None:  # depth one: sum min(p, q)
                q = filtered_probs(self._proposal_logits, **params)
                self.out_acceptance.copy_(torch.where(
                    active, acceptance_probability(target_probs[:, 0], q), -1.0))
            if self._beyond_logits is not None:
                q = filtered_probs(self._beyond_logits, **params)
                self._report_beyond(acceptance_probability(target_probs[:, d], q),
                                    lengths, active)
        else:  # every lane greedy: the same verification from argmax tokens
            target_tokens = greedy_tokens(lane_logits)
            result = verify_greedy(draft_tokens=drafts, target_tokens=target_tokens,
                                   lengths=lengths, vocab_size=lane_logits.shape[-1])
            if self._beyond_logits is not None:
                # greedy: the next proposal holds iff it is the target's argmax at row D,
                # after the drafted prefix (for a fully accepted lane: the bonus token)
                match = greedy_tokens(self._beyond_logits) == target_tokens[:, d]
                self._report_beyond(match.to(torch.float32), lengths, active)

        # outputs
        j = torch.arange(w, device=rows.device)[None, :]
        evaluated_rows = j < lengths[:, None]
        finite = (torch.isfinite(lane_logits).all(dim=-1) | ~evaluated_rows).all(dim=1)
        in_context = n + lengths <= self._cache.geometry.max_context
        self.out_tokens.copy_(result.tokens)
        # one log-softmax for the emitted logprobs and the top alternatives (a lane with
        # non-finite logits reports finite=False; its cleaned values are never used)
        log_probs = target_log_probs(lane_logits)
        self.out_logprobs.copy_(pick_logprobs(log_probs, result.tokens))
        top_lp, top_id = log_probs.topk(self.out_top_token.shape[2], dim=-1)
        self.out_top_token.copy_(top_id)
        self.out_top_logprob.copy_(top_lp)
        self.out_finite.copy_(finite & in_context)
        self.out_counts.copy_(torch.stack([result.accepted, result.evaluated, lengths, proposed]))
        self.out_survival.copy_(result.survival)
        self.out_drafts.copy_(drafts)

        # 5. commit: pending token, position, history (KV rolls back by position)
        emitted_pos = n[:, None] + 1 + j
        emits = j < result.emitted[:, None]
        ds.record(rows[:, None].expand(b, w).reshape(-1), emitted_pos.reshape(-1),
                  result.tokens.reshape(-1), emits.reshape(-1))
        st.pending_token.index_copy_(0, rows, torch.where(active, result.next_token, pending))
        st.position.index_copy_(0, rows, n + result.emitted)
        if self.catches_up:  # the draft KV is current through the accepted drafts now
            st.draft_position.index_copy_(
                0, rows, torch.where(active, n + result.emitted, st.draft_position[rows]))

    def _target_forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                        lane: torch.Tensor, tables: torch.Tensor, layout: PackedLayout,
                        lengths: torch.Tensor) -> torch.Tensor:
        """The one target forward over the packed lane rows; their hidden states.
        Rectangular programs attend lane-major; ragged ones attend per lane too, through
        a phase split that gathers each lane's rows into a ``[B, W]`` query block
        (``_ragged_split``), instead of every row attending every lane's keys."""
        return self._decoder.forward(PackedBatch(
            token_ids=ids, positions=pos, write_slots=slots, token_lane=lane,
            lane_block_tables=tables, lane_major_width=self.width if self.rectangular else 0,
            phase_split=None if self.rectangular else self._ragged_split(layout, lengths),
        ), self._cache)

    def _ragged_split(self, layout: PackedLayout, lengths: torch.Tensor) -> PhaseSplit:
        """Per-lane attention for ragged rows: lane ``r``'s row ``j`` sits at packed index
        ``lane_offset[r] + j`` while ``j < lengths[r]``, else nowhere (index P). The
        split's prompt phase is one empty query (index P) on a one-page table, so it
        costs one tiny attention and writes nothing that is read."""
        j = torch.arange(self.width, device=lengths.device)[None, :]
        slots = torch.where(j < lengths[:, None], layout.lane_offset[:, None] + j,
                            self.rows_total)
        return PhaseSplit(prompt_slots=self._split_none, prompt_lane=self._split_lane,
                          decode_slots=slots.reshape(-1), width=self.width,
                          prompt_block_table=self._split_table)

    def _layout(self, lengths: torch.Tensor) -> PackedLayout:
        if not self.rectangular:
            return packed_layout(lengths, self.rows_total)
        lane, depth, offset = self._lane_major
        return PackedLayout(row_lane=lane, row_depth=depth, row_used=depth < lengths[lane],
                            lane_offset=offset)

    def _report_beyond(self, value: torch.Tensor, lengths: torch.Tensor,
                       active: torch.Tensor) -> None:
        """``out_beyond``: ``value`` for lanes that verified all ``D`` drafts (``D + 1``
        target rows: row ``D`` is where a ``(D + 1)``-th draft would have been verified),
        whatever they accepted; -1 for the others. A depth-``(D + 1)`` counterfactual for
        learned rounds (``docs/speculative-selection.md``). Reporting it only for fully
        accepted lanes would observe depth ``D + 1`` only after success and bias its
        mean up to ``s_(D+1) / s_D``."""
        verified = active & (lengths == self.depth + 1)
        self.out_beyond.copy_(torch.where(verified, value.clamp(0.0, 1.0), -1.0))

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


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeReadout:
    """A round's output buffers as host arrays; ``result()`` builds the
    ``SpeculativeResult`` on the reader's thread (``speculative_result_of``), so the
    stream's worker only copies."""

    rows: tuple[int, ...]
    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    finite: np.ndarray
    counts: np.ndarray
    """``[4, lanes]``: accepted, evaluated, target rows, proposed."""
    survival: np.ndarray
    drafts: np.ndarray
    confidence: np.ndarray
    proposals: np.ndarray | None = None
    """Width-one learned rounds: the draft's greedy proposal per slot (-1: none)."""
    acceptances: np.ndarray | None = None
    """Width-one learned rounds with a sampled lane: ``sum min(p, q)`` per slot (-1:
    none)."""
    beyond: np.ndarray | None = None
    """Learned rounds with ``D >= 1``: the depth-``(D + 1)`` counterfactual per slot
    (-1: none)."""

    def result(self) -> SpeculativeResult:
        accepted, evaluated, target_rows, proposed = self.counts.tolist()
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        finite, survival, drafts = (self.finite.tolist(), self.survival.tolist(),
                                    self.drafts.tolist())
        proposals = (self.proposals.tolist() if self.proposals is not None
                     else [-1] * len(self.rows))
        acceptances = (self.acceptances.tolist() if self.acceptances is not None
                       else [-1.0] * len(self.rows))
        beyond = self.beyond.tolist() if self.beyond is not None else [-1.0] * len(self.rows)
        lanes = []
        for i, row in enumerate(self.rows):
            count = accepted[i] + 1
            lanes.append(SpeculativeLane(
                row=row, tokens=tuple(tokens[i][:count]), logprobs=tuple(logprobs[i][:count]),
                top_logprobs=tuple(tuple(zip(top_ids[i][k], top_lps[i][k], strict=True))
                                   for k in range(count)),
                finite=bool(finite[i]), accepted=accepted[i], evaluated=evaluated[i],
                target_rows=target_rows[i], proposed=proposed[i],
                survival=tuple(survival[i][:evaluated[i]]),
                drafts=tuple(drafts[i][:proposed[i]]), draft_proposal=proposals[i],
                draft_acceptance=acceptances[i], beyond=beyond[i],
            ))
        return SpeculativeResult(lanes=tuple(lanes), confidence=self.confidence,
                                 survival=self.survival)


def speculative_result_of(outputs: Mapping[str, Any]) -> Any:
    """The result inside a speculative program's ``read_outputs`` mapping, built here
    from its ``SpeculativeReadout`` (anything else is returned as it is, for the
    validator to reject)."""
    result = outputs.get(RESULT_KEY)
    return result.result() if isinstance(result, SpeculativeReadout) else result


def _gather_to_host(values: torch.Tensor, rows: list[int]) -> np.ndarray:
    """``values[rows]`` copied to a host array (a device round trip)."""
    index = torch.as_tensor(rows, dtype=torch.int64, device=values.device)
    return values.index_select(0, index).cpu().numpy()


def attach_speculation(
    engine: ModelEngine, shapes: Sequence[GraphShape], *, source: str,
    draft_model_dir: str | Path | None = None, copy_max_ngram: int = COPY_MAX_NGRAM,
    draft_catch_up: int = 0,
) -> DraftState:
    """Give ``engine`` speculative programs for ``shapes`` (``SPECULATIVE`` shapes and
    ``speculation_enabled`` mixed shapes of any width; proposal ``source``: ``"draft"``
    with ``draft_model_dir``, or ``"copy"``) and wrap its prefill / decode / mixed
    programs and state operations so they keep the draft context and token history
    current (SPEC-5); ``draft_catch_up = K > 0`` lets the learned draft's context lag
    behind ordinary decodes and catch up, at most K positions, inside the next round
    (``gpu.draft_state``). Returns the shared draft state."""
    parts = engine.parts
    draft = None
    if source == LEARNED:
        if draft_model_dir is None:
            raise ValueError("the learned draft source needs draft_model_dir")
        draft = load_draft_model(draft_model_dir, target=parts.decoder, target_cache=parts.cache)
    draft_state = DraftState(parts.state, draft, device=engine.device, catch_up=draft_catch_up)
    for shape, program in list(engine.programs.items()):
        if isinstance(program, StepProgram):
            engine.programs[shape] = DraftMaintainingProgram(program, draft_state)
        elif isinstance(program, StateOpProgram):
            engine.programs[shape] = DraftMaintainingStateOp(program, draft_state)
    for shape in shapes:
        if shape.kind is GraphKind.MIXED and shape.token_capacity > 1:
            from gpu.programs.speculative_mixed import SpeculativeMixedProgram

            engine.programs[shape] = SpeculativeMixedProgram(
                shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
                draft_state=draft_state, source=source, copy_max_ngram=copy_max_ngram,
                execution=parts.execution)
            continue
        if shape.kind is GraphKind.MIXED:
            engine.programs[shape] = DraftMaintainingProgram(
                _width_one_mixed(shape, engine), draft_state)
            continue
        engine.programs[shape] = SpeculativeProgram(
            shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
            draft_state=draft_state, source=source, copy_max_ngram=copy_max_ngram,
            execution=parts.execution)
    return draft_state


def is_speculative_shape(shape: GraphShape) -> bool:
    """Whether ``attach_speculation`` (not ``ModelEngine.load``) builds ``shape``."""
    return shape.kind is GraphKind.SPECULATIVE or (
        shape.kind is GraphKind.MIXED and shape.speculation_enabled)


def load_speculative_engine(
    model_dir: str | Path, *, catalog: Sequence[GraphShape], source: str,
    draft_model_dir: str | Path | None = None, copy_max_ngram: int = COPY_MAX_NGRAM,
    draft_catch_up: int = 0, **load_options: Any,
) -> ModelEngine:
    """``ModelEngine.load`` for a speculative load: the ordinary shapes of ``catalog``
    through the engine, then every speculative and ``speculation_enabled`` mixed shape
    through ``attach_speculation`` (``load_options`` go to ``ModelEngine.load``)."""
    ordinary = [s for s in catalog if not is_speculative_shape(s)]
    engine = ModelEngine.load(model_dir, catalog=ordinary, **load_options)
    attach_speculation(engine, [s for s in catalog if is_speculative_shape(s)], source=source,
                       draft_model_dir=draft_model_dir, copy_max_ngram=copy_max_ngram,
                       draft_catch_up=draft_catch_up)
    return engine


def _width_one_mixed(shape: GraphShape, engine: ModelEngine) -> StepProgram:
    """The ordinary program behind a ``speculation_enabled`` width-one mixed shape
    (MIX-6, MIX-35: decode attention and direct updates; the wrapper keeps the draft
    context). Wider ones are ``SpeculativeMixedProgram``s."""
    if shape.token_capacity != 1 or not shape.speculation_enabled:
        raise UnsupportedShapeError(
            f"{shape.label()}: only width-one draft-maintaining mixed programs are built")
    parts = engine.parts
    workspace = parts.workspace
    if shape.max_packed_extent > workspace.max_tokens or shape.batch_capacity > \
            workspace.max_lanes:
        # the engine's workspace was sized without this shape: give it its own
        device = str(parts.state.pending_token.device)
        workspace = Workspace(
            max_tokens=shape.max_packed_extent, max_lanes=shape.batch_capacity,
            device=device, sink_row=parts.state.sink_row,
            sink_page=parts.cache.geometry.sink_page,
            top_width=min(TOP_LOGPROBS, parts.decoder.config.vocab_size))
    return StepProgram(shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
                       workspace=workspace, execution=parts.execution)
