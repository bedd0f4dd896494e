"""Static program buffers, allocated once at the largest prepared capacity.

Owns the typed input and output buffers every packed program binds (MIX-38 (3)):
a program of a smaller shape takes contiguous leading views of them, so adding a
variant (including the later speculative B/D/W/P programs) allocates nothing new.
Programs run in stream order on one stream, so variants can share one workspace: a
frame's ``bind`` happens only after the previous frame's ``read_outputs``.

Until a frame is bound, every lane addresses the sink row and every slot the sink page,
so a warm-up or capture ``execute`` before the first ``bind`` mutates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

        self._token = {
            "host_token": z(n, i64), "host_position": z(n, i64),
            "from_state": z(n, torch.bool), "lane_offset": z(n, i64),
            "token_lane": z(n, i64), "valid": z(n, torch.bool), "next_token": z(n, i64),
            "out_prompt_logprobs": z(n, f32),
            "prompt_slots": z(n, i64), "decode_slots": z(n, i64),
            "out_prompt_top_token": torch.zeros((n, top_width), dtype=i64, device=device),
            "out_prompt_top_logprob": torch.zeros((n, top_width), dtype=f32, device=device),
        }
        self._lane = {
            "lane_rows": z(r, i64, sink_row), "sample_index": z(r, i64),
            "commits_token": z(r, torch.bool), "absolute_position": z(r, i64, -1),
            "advance": z(r, i64), "out_token": z(r, i64), "out_logprob": z(r, f32),
            "out_finite": z(r, torch.bool),
            "out_top_token": torch.zeros((r, top_width), dtype=i64, device=device),
            "out_top_logprob": torch.zeros((r, top_width), dtype=f32, device=device),
        }
        # state operations: per lane source/destination rows and pages
        self._prompt_lane = z(1, i64)
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

    def packed_views(
        self, tokens: int, lanes: int, *, prompt_capacity: int, decode_width: int
    ) -> PackedBuffers:
        """Leading views for a program with ``tokens`` slots and ``lanes`` lanes."""
        if (tokens > self.max_tokens or lanes > self.max_lanes
                or max(prompt_capacity, lanes * decode_width) > self.max_tokens):
            raise ValueError("workspace smaller than the program; size it to the catalog")
        views = {k: t[:tokens] for k, t in self._token.items()}
        views.update({k: t[:lanes] for k, t in self._lane.items()})
        views["prompt_slots"] = self._token["prompt_slots"][:prompt_capacity]
        views["decode_slots"] = self._token["decode_slots"][:lanes * decode_width]
        views["prompt_lane"] = self._prompt_lane
        return PackedBuffers(**views)
