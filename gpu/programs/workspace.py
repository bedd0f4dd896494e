"""Static program buffers, allocated once at the largest prepared capacity.

Owns the typed input and output buffers every packed program binds (MIX-38 (3)):
a program of a smaller shape takes contiguous leading views of them, so adding a
variant (including the later speculative B/D/W/P programs) allocates nothing new.
Programs run in stream order on one stream, so variants can share one workspace: a
frame's ``bind`` happens only after the previous frame's ``read_outputs``.

The per-frame host inputs (token, slot and lane arrays) of every packed program live
in ONE contiguous byte block on the device, each input a typed view at a fixed offset
(the device views never move, so captured programs keep reading the same addresses).
A frame is packed on the host into a *host block* of the same layout (``host_block``,
typed views through ``host_views``), off the stream when the backend stages frames
at launch; ``upload`` then moves the whole block in a single copy: one host-to-device
transfer per frame instead of one per input. On a CUDA device the copy goes through
a pinned staging block; on the CPU it is one memcpy into the input block and no torch
call at all (each one releases the GIL, and getting it back from a busy trio thread
can take up to the interpreter's switch interval).

``InputBlock`` is the same contract for a program's own inputs: the complete
speculative programs keep their lane rows, limits and prompt chunk in one.

Until a frame is bound, every lane addresses the sink row and every slot the sink page,
so a warm-up or capture ``execute`` before the first ``bind`` mutates nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.programs.packing import HostInputs

# The packed programs' host inputs: name -> (dtype, sized per token slot or per lane).
# int64 inputs come first so every view starts 8-byte aligned; bool inputs follow.
_INPUT_LAYOUT: tuple[tuple[str, torch.dtype, str], ...] = (
    ("host_token", torch.int64, "token"), ("host_position", torch.int64, "token"),
    ("lane_offset", torch.int64, "token"), ("token_lane", torch.int64, "token"),
    ("next_token", torch.int64, "token"), ("prompt_slots", torch.int64, "token"),
    ("decode_slots", torch.int64, "token"),
    ("lane_rows", torch.int64, "lane"), ("sample_index", torch.int64, "lane"),
    ("absolute_position", torch.int64, "lane"), ("advance", torch.int64, "lane"),
    ("prompt_lane", torch.int64, "one"),
    ("from_state", torch.bool, "token"), ("valid", torch.bool, "token"),
    ("commits_token", torch.bool, "lane"),
)
_NUMPY = {torch.int64: np.dtype(np.int64), torch.bool: np.dtype(np.bool_),
          torch.float32: np.dtype(np.float32)}


@dataclass(frozen=True, slots=True)
class PackedBuffers:
    """Views for one packed program: ``N`` token slots and ``R`` lanes."""

    # per packed token slot [N]
    host_token: torch.Tensor  # int64: token uploaded by the host (prompt tokens)
    host_position: torch.Tensor  # int64: position of a host token
    from_state: torch.Tensor  # bool: token = pending token of its lane's row
    lane_offset: torch.Tensor  # int64: index within its lane (state position + this)
    token_lane: torch.Tensor  # int64: lane of the slot
    valid: torch.Tensor  # bool: a real token (padding writes only the sink page)
    next_token: torch.Tensor  # int64: scored prefill: the token to score (-1 none)
    # per lane [R]
    lane_rows: torch.Tensor  # int64: state row (sink row for inactive lanes)
    sample_index: torch.Tensor  # int64: packed slot whose logits the lane samples
    commits_token: torch.Tensor  # bool: lane writes its sample into pending_token
    absolute_position: torch.Tensor  # int64: >=0 sets position; -1: position += advance
    advance: torch.Tensor  # int64
    # phase split (mixed): packed index of each prompt / decode query (N: none)
    prompt_slots: torch.Tensor  # int64 [C]
    prompt_lane: torch.Tensor  # int64 [1]
    decode_slots: torch.Tensor  # int64 [R * W]
    # outputs
    out_token: torch.Tensor  # int64 [R]
    out_logprob: torch.Tensor  # float32 [R]
    out_finite: torch.Tensor  # bool [R]
    out_prompt_logprobs: torch.Tensor  # float32 [N]
    out_top_token: torch.Tensor  # int64 [R, K]
    out_top_logprob: torch.Tensor  # float32 [R, K]
    out_prompt_top_token: torch.Tensor  # int64 [N, K]
    out_prompt_top_logprob: torch.Tensor  # float32 [N, K]


class Workspace:
    """The shared buffers for packed programs and state operations."""

    def __init__(
        self,
        *,
        max_tokens: int,
        max_lanes: int,
        device: str,
        sink_row: int,
        sink_page: int,
        top_width: int,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_lanes = max_lanes
        i64, f32 = torch.int64, torch.float32
        n, r = max_tokens, max_lanes

        def z(size: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full((size,), fill, dtype=dtype, device=device)

        self._build_inputs(device, sink_row=sink_row)
        self._token = {
            "out_prompt_logprobs": z(n, f32),
            "out_prompt_top_token": torch.zeros((n, top_width), dtype=i64, device=device),
            "out_prompt_top_logprob": torch.zeros((n, top_width), dtype=f32, device=device),
        }
        self._lane = {
            "out_token": z(r, i64), "out_logprob": z(r, f32),
            "out_finite": z(r, torch.bool),
            "out_top_token": torch.zeros((r, top_width), dtype=i64, device=device),
            "out_top_logprob": torch.zeros((r, top_width), dtype=f32, device=device),
        }
        # state operations: per lane source/destination rows and pages
        self.copy_src_row = z(r, i64, sink_row)
        self.copy_dst_row = z(r, i64, sink_row)
        self.copy_dst_page = z(r, i64, -1)
        self.page_src = z(r, i64, sink_page)
        self.page_dst = z(r, i64, sink_page)
        self.copy_override = z(r, torch.bool)
        self.copy_temperature = z(r, f32)
        self.copy_top_p = z(r, f32)
        self.copy_top_k = z(r, i64)
        self.copy_seed = z(r, i64)

    def _build_inputs(self, device: str, *, sink_row: int) -> None:
        """The device input block, its host staging mirror and their typed views."""
        sizes = {"token": self.max_tokens, "lane": self.max_lanes, "one": 1}
        spans: dict[str, tuple[int, int, torch.dtype]] = {}
        offset = 0
        for name, dtype, per in _INPUT_LAYOUT:
            size = sizes[per] * dtype.itemsize
            spans[name] = (offset, size, dtype)
            offset += size
        self._spans = spans
        self._on_host = torch.device(device).type == "cpu"
        staging = torch.zeros(offset, dtype=torch.uint8,
                              pin_memory=torch.device(device).type == "cuda")
        defaults = self._typed(staging.numpy())
        defaults["lane_rows"][:] = sink_row
        defaults["absolute_position"][:] = -1
        self.inputs = staging if self._on_host else staging.to(device)
        """Device input block: every packed program's host inputs are views of it."""
        self._staging = staging
        self._staging_bytes = staging.numpy()
        """Pinned staging (a device), or the input block itself (the CPU)."""
        self._default_bytes = self._staging_bytes.copy()
        """Every input at its unbound default (sink row, no absolute position)."""
        self._inputs = {
            name: self.inputs[start:start + size].view(dtype)
            for name, (start, size, dtype) in spans.items()
        }

    def _typed(self, block: np.ndarray) -> dict[str, np.ndarray]:
        return {name: block[start:start + size].view(_NUMPY[dtype])
                for name, (start, size, dtype) in self._spans.items()}

    def host_block(self) -> np.ndarray:
        """A fresh host block in the input layout, every input at its unbound default
        (pack a frame into it; inputs outside the program's views keep the defaults)."""
        return self._default_bytes.copy()

    def host_views(
        self, block: np.ndarray, tokens: int, lanes: int, *, prompt_capacity: int,
        decode_width: int,
    ) -> HostInputs:
        """Typed views of ``block`` matching ``packed_views`` of the same sizes."""
        self._check_fits(tokens, lanes, prompt_capacity=prompt_capacity,
                         decode_width=decode_width)
        if block.shape != self._staging_bytes.shape or block.dtype != np.uint8:
            raise ValueError("not a host block of this workspace")
        return HostInputs(**self._leading(self._typed(block), tokens, lanes,
                                          prompt_capacity, decode_width))

    def upload(self, block: np.ndarray) -> None:
        """Copy a packed host block into the input block in one transfer (call in
        stream order, inside ``bind``)."""
        # memoryview assignment: a memcpy that keeps the GIL (numpy releases it for
        # copies this size, and the worker may then wait a switch interval for it)
        self._staging_bytes.data[:] = block.data
        if not self._on_host:
            self.inputs.copy_(self._staging)

    def _check_fits(
        self, tokens: int, lanes: int, *, prompt_capacity: int, decode_width: int
    ) -> None:
        if (tokens > self.max_tokens or lanes > self.max_lanes
                or max(prompt_capacity, lanes * decode_width) > self.max_tokens):
            raise ValueError("workspace smaller than the program; size it to the catalog")

    @staticmethod
    def _leading(views: dict[str, Any], tokens: int, lanes: int, prompt_capacity: int,
                 decode_width: int) -> dict[str, Any]:
        """A program's leading views of the input block (either side)."""
        per = {name: {"token": tokens, "lane": lanes, "one": 1}[size]
               for name, _, size in _INPUT_LAYOUT}
        per["prompt_slots"] = prompt_capacity
        per["decode_slots"] = lanes * decode_width
        return {name: views[name][:per[name]] for name in per}

    def packed_views(
        self, tokens: int, lanes: int, *, prompt_capacity: int, decode_width: int
    ) -> PackedBuffers:
        """Leading views for a program with ``tokens`` slots and ``lanes`` lanes."""
        self._check_fits(tokens, lanes, prompt_capacity=prompt_capacity,
                         decode_width=decode_width)
        views = {k: t[:tokens] for k, t in self._token.items()}
        views.update({k: t[:lanes] for k, t in self._lane.items()})
        views.update(self._leading(self._inputs, tokens, lanes, prompt_capacity, decode_width))
        return PackedBuffers(**views)


class InputBlock:
    """A program's own per-frame host inputs in one contiguous device block (the
    speculative programs' lane rows, limits and prompt chunk), with the same staging
    contract as the workspace's input block: a frame is packed into a ``host_block``
    (typed views through ``host_views``) off the stream, and ``upload`` moves it in a
    single copy. The device views (``views``) never move, so captured programs keep
    reading the same addresses.
    """

    def __init__(self, layout: Sequence[tuple[str, torch.dtype, int]], *, device: str,
                 defaults: Mapping[str, int | bool] | None = None) -> None:
        """``layout``: ``(name, dtype, count)`` per input; ``defaults``: each input's
        unbound value (0 unless given)."""
        spans: dict[str, tuple[int, int, torch.dtype]] = {}
        offset = 0
        for name, dtype, count in layout:
            offset = -(-offset // dtype.itemsize) * dtype.itemsize  # align each view
            spans[name] = (offset, count * dtype.itemsize, dtype)
            offset += count * dtype.itemsize
        self._spans = spans
        self._on_host = torch.device(device).type == "cpu"
        staging = torch.zeros(max(offset, 1), dtype=torch.uint8,
                              pin_memory=torch.device(device).type == "cuda")
        self._staging, self._staging_bytes = staging, staging.numpy()
        for name, value in (defaults or {}).items():
            self.host_views(self._staging_bytes)[name][:] = value
        self._default_bytes = self._staging_bytes.copy()
        self.block = staging if self._on_host else staging.to(device)
        """The device block every input is a view of."""
        self.views = {name: self.block[start:start + size].view(dtype)
                      for name, (start, size, dtype) in spans.items()}
        """Typed device views by input name, at their unbound defaults until a bind."""

    def host_block(self) -> np.ndarray:
        """A fresh host block, every input at its unbound default."""
        return self._default_bytes.copy()

    def host_views(self, block: np.ndarray) -> dict[str, np.ndarray]:
        """Typed views of a host block of this layout, by input name."""
        if block.shape != self._staging_bytes.shape or block.dtype != np.uint8:
            raise ValueError("not a host block of this input block")
        return {name: block[start:start + size].view(_NUMPY[dtype])
                for name, (start, size, dtype) in self._spans.items()}

    def upload(self, block: np.ndarray) -> None:
        """Copy a packed host block into the device block in one transfer (call in
        stream order, inside ``bind``); on the CPU a memcpy that keeps the GIL."""
        self._staging_bytes.data[:] = block.data
        if not self._on_host:
            self.block.copy_(self._staging)
