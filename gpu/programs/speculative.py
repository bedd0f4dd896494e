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

The host side (input block, output buffers, staging, binding, host-known bounds and
read-out) is ``SpeculativeBinding`` (``gpu.programs.speculative_binding``); what a
round takes and gives back is in ``gpu.programs.speculative_frames``.
"""

from __future__ import annotations

import torch

from gpu.model.batch import PackedBatch, PhaseSplit
from gpu.programs.execution import power_of_two_buckets
from gpu.programs.speculative_binding import LEARNED, SpeculativeBinding
from gpu.sampling import (
    clean_logits,
    process_logits,
    processing_after_drafts,
    top_alternatives,
)
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
    processed_log_probs_by_lane,
    propose_copy,
    sample_draft_tokens,
    target_log_probs,
    unpack_lane_rows,
    verify_drafts,
    verify_greedy,
    write_confidence_sidecar,
)


class SpeculativeProgram(SpeculativeBinding):
    """A prepared complete speculative program of one ``GraphShape``."""

    def _trace_windows(self) -> None:
        """Trace the draft's first step at every catch-up window (one graph per window
        serves every context width, ``gpu.model.capture``) on placeholder inputs that write
        only the sink page; tracing is preparation, left out of the launch's timing."""
        draft = self._draft.draft
        assert draft is not None
        self._untraced_windows = False
        geo = self._cache.geometry
        dev = self.lane_rows.device
        tables = torch.full((self.batch, 1), geo.sink_page, dtype=torch.int64, device=dev)
        for window in power_of_two_buckets(self._draft.catch_up + 1):
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
        # the ordinary sampler's logit processing, row i after the lane's drafts 0..i-1
        target_logits, min_p = lane_logits, None
        if self.any_processing:
            processing = processing_after_drafts(st.processing(rows), drafts)
            target_logits = process_logits(
                clean_logits(lane_logits.float()).reshape(b * w, -1), processing).view(b, w, -1)
            min_p = st.min_p[rows]
        if self.any_sampled:
            target_probs = filtered_probs_by_lane(target_logits, **params, min_p=min_p)
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
            target_tokens = greedy_tokens(target_logits)
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
        if self.execution.processed_logprobs:  # what the ordinary sampler would report
            log_probs = processed_log_probs_by_lane(target_logits, **params, min_p=min_p)
        else:
            log_probs = target_log_probs(lane_logits)
        self.out_logprobs.copy_(pick_logprobs(log_probs, result.tokens))
        top_id, top_lp = top_alternatives(log_probs, self.out_top_token.shape[2])
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
        if self.any_processing:
            st.record_outputs(rows, result.tokens, emits & active[:, None])
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

