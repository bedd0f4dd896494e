"""Host-side packing: turn a frame into the per-slot and per-lane arrays a packed
program uploads (written into a host block in the workspace's input layout, which
``bind`` uploads in one copy).

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
from dataclasses import dataclass, fields

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
class HostInputs:
    """The host arrays a packed program uploads, sized to the program's capacities.

    ``Workspace.host_views`` gives typed views of a host block in the workspace's input
    layout (so a frame's inputs reach the device in one copy); ``HostInputs.allocate``
    gives separate fresh arrays.
    """

    # per packed token slot [N]
    host_token: np.ndarray
    host_position: np.ndarray
    from_state: np.ndarray
    lane_offset: np.ndarray
    token_lane: np.ndarray
    valid: np.ndarray
    next_token: np.ndarray
    # per lane [R]
    lane_rows: np.ndarray
    sample_index: np.ndarray
    commits_token: np.ndarray
    absolute_position: np.ndarray
    advance: np.ndarray
    # phase split: [C], [1], [R * W]
    prompt_slots: np.ndarray
    prompt_lane: np.ndarray
    decode_slots: np.ndarray

    @classmethod
    def allocate(cls, limits: PackLimits) -> HostInputs:
        n, r = limits.token_slots, limits.lanes
        i64 = np.int64
        return cls(
            host_token=np.zeros(n, i64), host_position=np.zeros(n, i64),
            from_state=np.zeros(n, np.bool_), lane_offset=np.zeros(n, i64),
            token_lane=np.zeros(n, i64), valid=np.zeros(n, np.bool_),
            next_token=np.zeros(n, i64), lane_rows=np.zeros(r, i64),
            sample_index=np.zeros(r, i64), commits_token=np.zeros(r, np.bool_),
            absolute_position=np.zeros(r, i64), advance=np.zeros(r, i64),
            prompt_slots=np.zeros(limits.prompt_capacity, i64), prompt_lane=np.zeros(1, i64),
            decode_slots=np.zeros(r * limits.decode_width, i64),
        )


@dataclass(frozen=True, slots=True)
class HostPack(HostInputs):
    """One packed frame: the ``HostInputs`` it was packed into (for a program, views of
    the frame's own host block) and the layout facts read back later."""

    query_lengths: np.ndarray
    offsets: np.ndarray
    reports_sample: tuple[bool, ...]
    rows: tuple[int, ...]


_INPUT_FIELDS = tuple(f.name for f in fields(HostInputs))


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


def _read_only_arange(stop: int) -> np.ndarray:
    values = np.arange(stop, dtype=np.int64)
    values.setflags(write=False)
    return values


_IOTA = _read_only_arange(1024)


def _iota(stop: int) -> np.ndarray:
    """``0, 1, ..., stop-1`` as a read-only view of one cached array.

    ``np.arange`` releases the GIL; on the CPU backend a worker thread that releases it
    while the trio thread is busy waits up to the switch interval to get it back, so
    ``bind`` slices this array instead of calling ``arange`` per frame.
    """
    global _IOTA
    if len(_IOTA) < stop:
        _IOTA = _read_only_arange(max(stop, 2 * len(_IOTA)))
    return _IOTA[:stop]


def pack_lanes(
    limits: PackLimits,
    *,
    rows: Sequence[int],
    prefill_row: int,
    prompt_tokens: Sequence[int],
    prompt_start: int,
    prompt_ends: bool,
    following_token: int = -1,
    out: HostInputs | None = None,
) -> HostPack:
    """Validate and lay out one frame into ``out`` (fresh arrays when None).

    Every check runs first: on ``FrameError`` nothing has been written.
    """
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

    n_lanes = len(rows)
    width = limits.decode_width
    lengths = [n_prompt if lane == prefill_row else width for lane in range(n_lanes)]
    starts = [0] * n_lanes
    total = 0
    for lane, length in enumerate(lengths):  # exclusive prefix sums (MIX-12)
        starts[lane] = total
        total += length
    if total > limits.token_slots:
        raise FrameError(f"{total} packed tokens exceed the program's {limits.token_slots}")

    host = out if out is not None else HostInputs.allocate(limits)
    n = limits.token_slots
    # defaults: padding slots write only the sink page, unused lanes address the sink row
    for zeroed in (host.host_token, host.host_position, host.from_state, host.lane_offset,
                   host.token_lane, host.valid, host.sample_index, host.commits_token,
                   host.advance, host.prompt_lane):
        zeroed.fill(0)
    host.next_token.fill(-1)
    host.lane_rows.fill(limits.sink_row)
    host.absolute_position.fill(-1)
    host.prompt_slots.fill(n)
    host.decode_slots.fill(n)

    iota = _iota(max(total, n_lanes, width, prompt_start + n_prompt))
    offsets = np.array(starts, np.int64)
    lane_lengths = np.array(lengths, np.int64)
    host.lane_rows[:n_lanes] = rows
    host.sample_index[:n_lanes] = offsets + lane_lengths - 1
    host.valid[:total] = True
    host.token_lane[:total] = np.repeat(iota[:n_lanes], lane_lengths)
    decode = [lane for lane in range(n_lanes) if lane != prefill_row]
    if decode:
        # decode lanes: W tokens each from device state, at the lane's packed offset
        decode_starts = offsets[decode]
        within = iota[:width]
        decode_index = (decode_starts[:, None] + within).reshape(-1)
        host.from_state[decode_index] = True
        host.lane_offset[decode_index] = np.tile(within, len(decode))
        host.advance[decode] = width
        host.commits_token[decode] = True
        slots = host.decode_slots.reshape(limits.lanes, width)
        slots[decode] = decode_starts[:, None] + within
    if prefill_row != NO_PROMPT_ROW:
        start = starts[prefill_row]
        span = slice(start, start + n_prompt)
        host.host_token[span] = prompt_tokens
        host.host_position[span] = iota[prompt_start:prompt_start + n_prompt]
        host.next_token[start:start + n_prompt - 1] = prompt_tokens[1:]
        host.next_token[start + n_prompt - 1] = following_token
        host.absolute_position[prefill_row] = prompt_start + n_prompt
        host.prompt_slots[:n_prompt] = iota[start:start + n_prompt]
        host.prompt_lane[0] = prefill_row
        host.commits_token[prefill_row] = prompt_ends
    reports = tuple(lane != prefill_row or prompt_ends for lane in range(n_lanes))
    arrays = {name: getattr(host, name) for name in _INPUT_FIELDS}
    return HostPack(**arrays, query_lengths=lane_lengths, offsets=offsets,
                    reports_sample=reports, rows=rows)
