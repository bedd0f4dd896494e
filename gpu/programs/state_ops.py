"""State-operation programs (``GraphKind.STATE``): snapshot, restore, page copy, initialize.

Owns the device side of prompt checkpoints and restores (OPEN-39: restore and
initialization are state operations). SNAPSHOT copies a request's state row into a
checkpoint row; RESTORE copies a checkpoint row into a fresh request row. Both share
full pages by reference (the block table is copied) and copy the partial last page,
the one thing a continuation would overwrite, into a destination page, so snapshots
and restores preserve partial pages (PRE-37). Block-table entries past the cached
extent are cleared in the destination, so pages reserved ahead are never shared.
PAGE_COPY copies whole pages; INITIALIZE only applies its frame's state updates.
Inactive lanes copy the sink onto itself and mutate nothing. ``copy_rows`` is the one
row copy: SNAPSHOT and RESTORE lanes run it, and so do the row copies a prompt frame
carries (``apply_copies``: a window snapshot and its restore, ``actors.window_snapshots``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpu.frames import RESULT_KEY, FrameError, RowCopy, StateOpFrame, StateOpResult, frame_of
from gpu.model.kv_cache import PagedKVCache
from gpu.programs.workspace import Workspace
from gpu.request_state import NEUTRAL_PROCESSING, RequestState, StateError
from policy.descriptors import GraphKind, GraphShape, StateOp


class StateOpProgram:
    """A prepared state operation over ``batch_capacity`` lanes."""

    def __init__(
        self, shape: GraphShape, *, cache: PagedKVCache, state: RequestState, workspace: Workspace
    ) -> None:
        if shape.kind is not GraphKind.STATE or shape.state_op is None:
            raise ValueError("StateOpProgram runs GraphKind.STATE shapes")
        self._shape = shape
        self.op: StateOp = shape.state_op
        self._cache = cache
        self._state = state
        lanes = shape.batch_capacity
        self.src_row = workspace.copy_src_row[:lanes]
        self.dst_row = workspace.copy_dst_row[:lanes]
        self.dst_page = workspace.copy_dst_page[:lanes]
        self.page_src = workspace.page_src[:lanes]
        self.page_dst = workspace.page_dst[:lanes]
        self.override = workspace.copy_override[:lanes]
        self.sampling_values = {
            "temperature": workspace.copy_temperature[:lanes],
            "top_p": workspace.copy_top_p[:lanes],
            "top_k": workspace.copy_top_k[:lanes],
            "seed": workspace.copy_seed[:lanes],
        }
        self._lanes = 0
        self._copies_processing = True

    @property
    def shape(self) -> GraphShape:
        return self._shape

    def _validate(self, frame: StateOpFrame) -> int:
        st, cap = self._state, self._shape.batch_capacity
        try:
            if self.op in (StateOp.SNAPSHOT, StateOp.RESTORE):
                if frame.page_pairs:
                    raise FrameError("snapshot/restore frames carry copies, not page pairs")
                lanes = len(frame.copies)
                check_copies(st, frame.copies)
                dsts = [c.dst_row for c in frame.copies]
                if len(set(dsts)) != len(dsts):
                    raise FrameError("two copies write the same destination row")
            elif self.op is StateOp.PAGE_COPY:
                if frame.copies:
                    raise FrameError("page-copy frames carry page pairs, not row copies")
                lanes = len(frame.page_pairs)
                for src, dst in frame.page_pairs:
                    st.check_page(src)
                    st.check_page(dst)
            else:
                if frame.copies or frame.page_pairs:
                    raise FrameError("initialize frames carry only state updates")
                lanes = len(frame.updates)
        except StateError as exc:
            raise FrameError(str(exc)) from exc
        if self.op is not StateOp.INITIALIZE and lanes > cap:
            raise FrameError(f"{lanes} lanes exceed batch capacity {cap}")
        return lanes

    def bind(self, inputs: Mapping[str, Any]) -> None:
        frame = frame_of(inputs)
        if not isinstance(frame, StateOpFrame):
            raise FrameError(f"{self._shape.label()} takes a StateOpFrame")
        lanes = self._validate(frame)
        self._state.validate_updates(frame.updates)
        self._state.apply_updates(frame.updates)
        sink_row, sink_page = self._state.sink_row, self._cache.geometry.sink_page
        cap = self._shape.batch_capacity
        src = [sink_row] * cap
        dst = [sink_row] * cap
        dpage = [-1] * cap
        psrc = [sink_page] * cap
        pdst = [sink_page] * cap
        override = [False] * cap
        sampling: dict[str, list[float] | list[int]] = {
            "temperature": [0.0] * cap, "top_p": [1.0] * cap, "top_k": [0] * cap, "seed": [0] * cap,
        }
        for i, c in enumerate(frame.copies):
            src[i], dst[i], dpage[i] = c.src_row, c.dst_row, c.dst_page
            if c.sampling is not None:
                override[i] = True
                for name in sampling:
                    sampling[name][i] = getattr(c.sampling, name)
        self.override.copy_(torch.tensor(override, dtype=torch.bool))
        for name, buf in self.sampling_values.items():
            buf.copy_(torch.tensor(sampling[name], dtype=buf.dtype))
        for i, (s, d) in enumerate(frame.page_pairs):
            psrc[i], pdst[i] = s, d
        for buf, values in ((self.src_row, src), (self.dst_row, dst), (self.dst_page, dpage),
                            (self.page_src, psrc), (self.page_dst, pdst)):
            buf.copy_(torch.tensor(values, dtype=torch.int64))
        self._lanes = lanes
        # On the CPU, rows with no logit processing skip copying its state (their own is
        # neutral whatever it holds; ``gpu.request_state``); on a device, always copied.
        self._copies_processing = (self._state.host_views is None
                                   or self._state.any_processing([*src, *dst]))

    def execute(self) -> None:
        if self.op in (StateOp.SNAPSHOT, StateOp.RESTORE):
            self._copy_rows()
        elif self.op is StateOp.PAGE_COPY:
            self._cache.copy_pages(self.page_src, self.page_dst)

    def _copy_rows(self) -> None:
        copy_rows(self._state, self._cache, src=self.src_row, dst=self.dst_row,
                  dst_page=self.dst_page, override=self.override,
                  sampling_values=self.sampling_values,
                  processing=self._copies_processing)

    def read_outputs(self) -> dict[str, Any]:
        return {RESULT_KEY: StateOpResult(lanes=self._lanes)}


def check_copies(state: RequestState, copies: Sequence[RowCopy]) -> None:
    """Refuse copies naming a row or page the state does not have, or a row onto
    itself (``FrameError``)."""
    try:
        for c in copies:
            state.check_row(c.src_row)
            state.check_row(c.dst_row)
            if c.src_row == c.dst_row:
                raise FrameError("a row copy needs distinct source and destination")
            if c.dst_page != -1:
                state.check_page(c.dst_page)
    except StateError as exc:
        raise FrameError(str(exc)) from exc


def apply_copies(state: RequestState, cache: PagedKVCache, copies: Sequence[RowCopy]) -> None:
    """Run ``copies`` one after another (each may read what the one before wrote), as
    a SNAPSHOT or RESTORE lane would: the copies a prompt frame carries (a window
    snapshot and its restore, ``gpu.frames.PrefillFrame.copies``). Their sampling is
    the copied row's own."""
    device = state.position.device
    for c in copies:
        src, dst, page = (torch.tensor([v], dtype=torch.int64, device=device)
                          for v in (c.src_row, c.dst_row, c.dst_page))
        processing = state.host_views is None or state.any_processing([c.src_row, c.dst_row])
        copy_rows(state, cache, src=src, dst=dst, dst_page=page,
                  override=torch.zeros(1, dtype=torch.bool, device=device),
                  sampling_values={}, processing=processing)


def copy_rows(state: RequestState, cache: PagedKVCache, *, src: torch.Tensor,
              dst: torch.Tensor, dst_page: torch.Tensor, override: torch.Tensor,
              sampling_values: Mapping[str, torch.Tensor], processing: bool) -> None:
    """Copy rows ``src -> dst`` (int64 ``[L]`` each): every state field, full pages
    shared by reference, the partial last page copied into ``dst_page`` where it is
    not -1 (PRE-37), block-table entries past the copied extent cleared; lanes with
    ``override`` take ``sampling_values`` in place of the copied sampling (and neutral
    logit processing). ``processing``: copy the logit-processing state too."""
    st, geo, dpage = state, cache.geometry, dst_page
    ps, sink = geo.page_size, geo.sink_page
    pos = st.position[src]
    partial_block = torch.div(pos, ps, rounding_mode="floor").clamp(max=geo.blocks_per_row - 1)
    has_partial = (pos % ps != 0) & (dpage >= 0)
    src_tables = st.block_table[src]
    src_page = src_tables.gather(1, partial_block[:, None]).squeeze(1)
    sink_t = torch.full_like(dpage, sink)
    cache.copy_pages(
        torch.where(has_partial, src_page, sink_t), torch.where(has_partial, dpage, sink_t)
    )
    fields = st.fields()
    if not processing:
        for name in st.processing_fields():
            del fields[name]
    copied = {name: t[src] for name, t in fields.items()}
    block_index = torch.arange(geo.blocks_per_row, device=pos.device)[None, :]
    full_blocks = torch.div(pos, ps, rounding_mode="floor")[:, None]
    tables = torch.where(block_index < full_blocks, src_tables, sink)
    tables = torch.where(
        (block_index == partial_block[:, None]) & has_partial[:, None], dpage[:, None], tables
    )
    copied["block_table"] = tables
    for name, value in sampling_values.items():
        copied[name] = torch.where(override, value, copied[name])
    for name in st.processing_fields() if processing else ():
        value = copied[name]  # a replaced sampling has no processing
        flag = override.view(-1, *([1] * (value.dim() - 1)))
        copied[name] = torch.where(flag, torch.full_like(value, NEUTRAL_PROCESSING.get(
            name, 0)), value)
    for name, tensor in fields.items():
        tensor.index_copy_(0, dst, copied[name])
