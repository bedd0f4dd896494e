"""Host-side packing: turn a frame into the per-slot and per-lane arrays a packed
program uploads (one upload per buffer per frame).

Owns the *Mixed execution contract* layout: every lane has a logical query length;
packed token offsets are prefix sums of those lengths in dense lane order,
independent of state-row ids (MIX-11, MIX-12); prompt tokens and positions sit at the
prompt lane's packed offset (MIX-13); at most one prompt lane (MIX-8, MIX-9); unused
lanes point at the sink row and unused slots write only the sink page (MIX-15).
Prefill (one prompt lane) and decode (no prompt lane) are the two special cases.
Pure numpy: no device work happens here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpu.frames import NO_PROMPT_ROW, FrameError


def packed_offsets(query_lengths: Sequence[int]) -> np.ndarray:
    """Start offset of each lane's tokens: exclusive prefix sums of query lengths (MIX-12)."""
    lengths = np.asarray(query_lengths, dtype=np.int64)
    if (lengths < 0).any():
        raise FrameError("query lengths must be non-negative (MIX-11)")
    if not len(lengths):
        return lengths
    return np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)


@dataclass(frozen=True, slots=True)
class HostPack:
    """The host arrays of one packed frame, sized to the program's capacities."""

    host_token: np.ndarray
    host_position: np.ndarray
    from_state: np.ndarray
    lane_offset: np.ndarray
    token_lane: np.ndarray
    valid: np.ndarray
    next_token: np.ndarray
    lane_rows: np.ndarray
    sample_index: np.ndarray
    commits_token: np.ndarray
    absolute_position: np.ndarray
    advance: np.ndarray
    prompt_slots: np.ndarray
    prompt_lane: np.ndarray
    decode_slots: np.ndarray
    query_lengths: np.ndarray
    offsets: np.ndarray
    reports_sample: tuple[bool, ...]
    rows: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PackLimits:
    """Capacities and ranges a frame must fit."""

    token_slots: int
    lanes: int
    decode_width: int
    prompt_capacity: int
    state_rows: int
    sink_row: int
    vocab_size: int
    max_context: int


def pack_lanes(
    limits: PackLimits,
    *,
    rows: Sequence[int],
    prefill_row: int,
    prompt_tokens: Sequence[int],
    prompt_start: int,
    prompt_ends: bool,
    following_token: int = -1,
) -> HostPack:
    """Validate and lay out one frame (raises ``FrameError``; nothing is written)."""
    rows = tuple(int(r) for r in rows)
    if len(rows) > limits.lanes:
        raise FrameError(f"{len(rows)} lanes exceed batch capacity {limits.lanes}")
    if len(set(rows)) != len(rows):
        raise FrameError("a state row appears twice in one frame")
    for r in rows:
        if not 0 <= r < limits.state_rows:
            raise FrameError(f"state row {r} outside 0..{limits.state_rows - 1}")
    if prefill_row != NO_PROMPT_ROW and not 0 <= prefill_row < len(rows):
        raise FrameError(
            f"prefill_row {prefill_row} is not -1 or a lane index below {len(rows)} (MIX-9)"
        )
    n_prompt = len(prompt_tokens)
    if prefill_row == NO_PROMPT_ROW:
        if n_prompt or prompt_ends:
            raise FrameError("prompt tokens given without a prompt row")
    else:
        if n_prompt == 0:
            raise FrameError("a prompt row needs at least one prompt token")
        if n_prompt > limits.prompt_capacity:
            raise FrameError(f"{n_prompt} prompt tokens exceed capacity {limits.prompt_capacity}")
        if prompt_start < 0 or prompt_start + n_prompt > limits.max_context:
            raise FrameError("prompt positions fall outside the model context")
        bad = [t for t in prompt_tokens if not 0 <= t < limits.vocab_size]
        if bad:
            raise FrameError(f"prompt token ids outside the vocabulary: {bad[:3]}")
    if following_token >= limits.vocab_size:
        raise FrameError("following_token outside the vocabulary")

    lengths = [
        n_prompt if lane == prefill_row else limits.decode_width for lane in range(len(rows))
    ]
    offsets = packed_offsets(lengths)
    total = int(sum(lengths))
    if total > limits.token_slots:
        raise FrameError(f"{total} packed tokens exceed the program's {limits.token_slots}")

    n, r = limits.token_slots, limits.lanes
    host_token = np.zeros(n, np.int64)
    host_position = np.zeros(n, np.int64)
    from_state = np.zeros(n, np.bool_)
    lane_offset = np.zeros(n, np.int64)
    token_lane = np.zeros(n, np.int64)
    valid = np.zeros(n, np.bool_)
    next_token = np.full(n, -1, np.int64)
    lane_rows = np.full(r, limits.sink_row, np.int64)
    sample_index = np.zeros(r, np.int64)
    commits = np.zeros(r, np.bool_)
    absolute = np.full(r, -1, np.int64)
    advance = np.zeros(r, np.int64)
    prompt_slots = np.full(limits.prompt_capacity, n, np.int64)
    prompt_lane = np.zeros(1, np.int64)
    decode_slots = np.full(r * limits.decode_width, n, np.int64)
    reports: list[bool] = []
    for lane, (row, length, start) in enumerate(zip(rows, lengths, offsets, strict=True)):
        span = slice(int(start), int(start) + length)
        lane_rows[lane] = row
        token_lane[span] = lane
        valid[span] = True
        sample_index[lane] = start + length - 1
        if lane == prefill_row:
            host_token[span] = prompt_tokens
            host_position[span] = np.arange(prompt_start, prompt_start + length)
            next_token[span][:-1] = prompt_tokens[1:]
            next_token[int(start) + length - 1] = following_token
            absolute[lane] = prompt_start + length
            prompt_slots[:length] = np.arange(start, start + length)
            prompt_lane[0] = lane
            commits[lane] = prompt_ends
            reports.append(prompt_ends)
        else:
            from_state[span] = True
            lane_offset[span] = np.arange(length)
            advance[lane] = length
            first = lane * limits.decode_width
            decode_slots[first:first + length] = np.arange(start, start + length)
            commits[lane] = True
            reports.append(True)
    return HostPack(
        host_token=host_token, host_position=host_position, from_state=from_state,
        lane_offset=lane_offset, token_lane=token_lane, valid=valid, next_token=next_token,
        lane_rows=lane_rows, sample_index=sample_index, commits_token=commits,
        absolute_position=absolute, advance=advance, prompt_slots=prompt_slots,
        prompt_lane=prompt_lane, decode_slots=decode_slots,
        query_lengths=np.asarray(lengths, np.int64), offsets=offsets,
        reports_sample=tuple(reports), rows=rows,
    )
