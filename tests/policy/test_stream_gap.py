"""Covers U-13, flare's stream gap limit (``stream_gap_ratio``; docs/scheduling-utility.md).

Without a throughput knee the value-per-time score lets a waiting prompt's chunk grow
until a frame beside the decoding streams runs far longer than their decode frame. With
the limit, while streams decode, a prompt chunk rides beside every one of them, no
stream waits for its next output more than r times the shortest frame that carries
them with a chunk, and the prompt still finishes.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from policy import GraphKind, GraphShape, LaneRole, Phase, SelectionReason
from policy.config import PolicyConfig, PolicyConfigError, policy_preset
from tests.policy.synthetic_catalog import (
    MS,
    Driver,
    decode,
    knee_free_costs,
    measured_scheduler,
    mixed,
    prefill,
)

PREFILLS = tuple(prefill(c) for c in (64, 256, 1024))
DECODES = tuple(decode(b) for b in (1, 2, 4, 8))
MIXED = tuple(mixed(b, c) for b in (2, 4, 8) for c in (64, 128, 256, 512))
STREAMS = 4


linear_ns = knee_free_costs(prefill_ms=2.0, decode_ms=8.0, mixed_token_ms=0.02)
"""No knee: every prompt token costs the same in a mixed frame as alone."""


DECODE_4_MS = linear_ns(decode(STREAMS)) / MS
SHORTEST_CARRIER_MS = linear_ns(mixed(8, 64)) / MS
"""The shortest frame carrying four streams beside a chunk (B - 1 >= 4)."""


def gap_limited(ratio: float, **fields: object) -> PolicyConfig:
    return replace(policy_preset("first-token"), stream_gap_ratio=ratio, **fields)


def long_prompt_run(config: PolicyConfig, shapes: tuple[GraphShape, ...] = (
        *PREFILLS, *DECODES, *MIXED), *, warm_frames: int = 20, prompt_len: int = 2048,
        host_gap_ns: int = 0, publish_late: bool = False) -> tuple[Driver, list[int], int]:
    """Four streams decode for ``warm_frames`` frames, then a ``prompt_len``-token prompt
    arrives; run to its first output. Returns the driver, the streams' handles and the
    index of the first plan after the prompt arrived."""
    s = measured_scheduler(shapes, config, durations=linear_ns)
    d = Driver(s, durations=linear_ns, host_gap_ns=host_gap_ns, publish_late=publish_late)
    streams = [s.admit(prompt_len=64, max_output_tokens=2000) for _ in range(STREAMS)]
    d.run(warm_frames)
    start = len(d.trace.plans)
    h = s.admit(prompt_len=prompt_len, max_output_tokens=8)
    for _ in range(500):
        assert d.step() is not None
        if d.trace.first_output_ns(h) is not None:
            return d, streams, start
    raise AssertionError("no first output in 500 frames")


def chunk_frames(d: Driver, start: int) -> list[tuple[float, int]]:
    """Each frame after ``start`` that ran a prompt chunk: its duration (ms) and how
    many decoding streams it carried."""
    return [(linear_ns(p.shape) / MS, sum(lane.role is LaneRole.DECODE for lane in p.lanes))
            for p in d.trace.plans[start:] if p.shape.kind is not GraphKind.DECODE]


def longest_output_gap_ms(d: Driver, streams: list[int], start: int) -> float:
    """The longest any stream waited for an output after plan ``start`` began, to the
    end of the run (a wait still open at the end counts)."""
    t0 = d.trace.plan_ns[start]
    end = d.sched.now_ns
    gaps = []
    for h in streams:
        times = [*d.trace.output_times(h), end]
        gaps += [b - a for a, b in itertools.pairwise(times) if b > t0]
    return max(gaps) / MS


def test_without_the_limit_a_waiting_prompt_stretches_the_frames() -> None:
    d, streams, start = long_prompt_run(policy_preset("first-token"))
    assert max(ms for ms, _ in chunk_frames(d, start)) > 1.5 * DECODE_4_MS
    assert longest_output_gap_ms(d, streams, start) > 1.5 * DECODE_4_MS


@pytest.mark.parametrize("ratio", [1.2, 1.5])
def test_every_chunk_rides_beside_every_stream_within_the_limit(ratio: float) -> None:
    d, streams, start = long_prompt_run(gap_limited(ratio))
    frames = chunk_frames(d, start)
    assert frames and all(carried == STREAMS for _, carried in frames)
    assert max(ms for ms, _ in frames) <= ratio * SHORTEST_CARRIER_MS
    assert longest_output_gap_ms(d, streams, start) <= ratio * SHORTEST_CARRIER_MS
    # The limit is what it allows: the prompt's chunks grow up to it.
    assert max(ms for ms, _ in frames) > (ratio - 0.2) * SHORTEST_CARRIER_MS


def test_at_ratio_one_the_shortest_carrying_frame_still_runs() -> None:
    d, streams, start = long_prompt_run(gap_limited(1.0))
    assert {ms for ms, _ in chunk_frames(d, start)} == {SHORTEST_CARRIER_MS}
    assert longest_output_gap_ms(d, streams, start) <= SHORTEST_CARRIER_MS


def test_without_a_mixed_program_a_left_out_stream_waits_at_most_the_limit() -> None:
    # Prefill frames leave every stream out; each one holds them for itself and their
    # decode frame, and prefills may not run back to back past the limit.
    ratio = 2.0
    shortest = linear_ns(prefill(64)) / MS + DECODE_4_MS
    d, streams, start = long_prompt_run(gap_limited(ratio), (*PREFILLS, *DECODES))
    assert chunk_frames(d, start)
    assert longest_output_gap_ms(d, streams, start) <= ratio * shortest


def test_a_timing_refresh_keeps_the_limit() -> None:
    # Estimates expire after 1 ms, so a funded refresh picks a stale shape; the first
    # one is funded after about 2.5 s of work, which the prompt arrives just before.
    d, streams, start = long_prompt_run(gap_limited(1.2, estimate_ttl_ns=MS),
                                        warm_frames=295, prompt_len=8192)
    assert any(p.reason is SelectionReason.TIMING_REFRESH for p in d.trace.plans[start:])
    assert longest_output_gap_ms(d, streams, start) <= 1.2 * SHORTEST_CARRIER_MS


@pytest.mark.parametrize("publish_late", [False, True])
def test_host_time_between_frames_does_not_spend_the_limit(publish_late: bool) -> None:
    # 2 ms of host time before each plan, and optionally each frame's outputs published
    # only after the next frame is planned: a stream's last visible output is then a
    # frame older than its latest completed frame. Neither is a frame holding the
    # streams, so the chunks still grow to the limit.
    gap_ns = 2 * MS
    d, streams, start = long_prompt_run(gap_limited(1.2), host_gap_ns=gap_ns,
                                        publish_late=publish_late)
    frames = chunk_frames(d, start)
    assert frames and all(carried == STREAMS for _, carried in frames)
    assert max(ms for ms, _ in frames) > SHORTEST_CARRIER_MS
    assert max(ms for ms, _ in frames) <= 1.2 * SHORTEST_CARRIER_MS
    assert longest_output_gap_ms(d, streams, start) <= 1.2 * SHORTEST_CARRIER_MS + gap_ns / MS


def test_a_ratio_below_one_is_refused() -> None:
    assert PolicyConfig(stream_gap_ratio=0.0).stream_gap_ratio == 0
    assert PolicyConfig(stream_gap_ratio=1.0).stream_gap_ratio == 1
    with pytest.raises(PolicyConfigError, match="stream_gap_ratio"):
        PolicyConfig(stream_gap_ratio=0.5)


def test_a_stream_just_started_has_waited_only_since_its_first_output_frame() -> None:
    # A prompt finishes while four streams decode; its first output is published only
    # after the next frame is planned. That plan may not count the new stream as
    # having waited since its admission: the streams' allowance stays the full r*S.
    s = measured_scheduler((*PREFILLS, *DECODES, *MIXED), gap_limited(1.2),
                           durations=linear_ns)
    d = Driver(s, durations=linear_ns, publish_late=True)
    for _ in range(STREAMS):
        s.admit(prompt_len=64, max_output_tokens=2000)
    d.run(10)
    h = s.admit(prompt_len=60, max_output_tokens=4)
    while s.request(h).phase is Phase.PREFILL:
        assert d.step() is not None
    s.admit(prompt_len=4096, max_output_tokens=4)  # a chunk waits for the next frame
    plan = d.step()
    assert plan is not None and plan.shape.kind is GraphKind.MIXED
    assert linear_ns(plan.shape) / MS > SHORTEST_CARRIER_MS
