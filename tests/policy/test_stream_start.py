"""Covers U-12, flare's stream-start value (``stream_start_ms``, the ``stream-start``
preset; docs/scheduling-utility.md).

A prompt one chunk does not finish leaves a short tail whose tokens are worth little
beside the decoders' next tokens; with the seed's single-token price for its first
output the tail waits behind decode frames until the decoders' fairness prices fall.
Pricing the first output as the stream it starts lets the prompt finish at once.

With no stream decoding, the seed's token-rate fairness shares the device among prompts
that arrive together: each runs its first chunk before any finishes. The stream-start
value, taken at one stream's delivery interval, finishes them one after another.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from policy import GraphKind, GraphShape
from policy.config import PolicyConfig, PolicyConfigError, policy_preset
from tests.policy.synthetic_catalog import MS, Driver, decode, measured_scheduler, mixed, prefill

SHAPES = (prefill(64), prefill(256), prefill(1024), *(decode(b) for b in (1, 2, 4)),
          *(mixed(b, c) for b in (2, 4) for c in (64, 128, 256)))


def cpu_like_ns(shape: GraphShape) -> int:
    """Costs shaped as the CPU backend's: no knee, a mixed frame costs about a decode
    frame plus its chunk."""
    if shape.kind is GraphKind.PREFILL:
        return round((2.0 + 0.045 * shape.token_capacity) * MS)
    if shape.kind is GraphKind.DECODE:
        return round((5.0 + 0.25 * shape.batch_capacity) * MS)
    return round((5.0 + 0.25 * shape.batch_capacity + 0.085 * shape.prefill_capacity) * MS)


def frames_to_first_output(config: PolicyConfig, prompt_len: int) -> int:
    """Frames from a prompt's arrival beside three decoding streams to its first output."""
    s = measured_scheduler(SHAPES, config, durations=cpu_like_ns)
    d = Driver(s, durations=cpu_like_ns)
    for _ in range(3):
        s.admit(prompt_len=64, max_output_tokens=400)
    d.run(40)
    h = s.admit(prompt_len=prompt_len, max_output_tokens=32)
    for frame in range(1, 200):
        d.step()
        if d.trace.first_output_ns(h) is not None:
            return frame
    raise AssertionError("no first output in 200 frames")


def test_the_seed_price_holds_a_prompt_tail_behind_the_decoders() -> None:
    # 64 tokens fit one chunk and finish at once; 70 leave a 6-token tail that waits.
    assert frames_to_first_output(policy_preset("balanced"), 64) == 1
    assert frames_to_first_output(policy_preset("balanced"), 70) > 20
    assert frames_to_first_output(policy_preset("first-token"), 70) > 20


@pytest.mark.parametrize("prompt_len", [64, 70, 129, 300])
def test_stream_start_finishes_the_prompt_beside_running_streams(prompt_len: int) -> None:
    assert frames_to_first_output(policy_preset("stream-start"), prompt_len) <= 2


def first_output_frames(config: PolicyConfig, prompts: int, prompt_len: int) -> list[int]:
    """The frame of each prompt's first output when ``prompts`` arrive together after
    every earlier stream has finished, in order."""
    s = measured_scheduler(SHAPES, config, durations=cpu_like_ns)
    d = Driver(s, durations=cpu_like_ns)
    for _ in range(4):
        s.admit(prompt_len=64, max_output_tokens=8)
    d.run(40)
    assert s.plan() is None  # every earlier stream has finished
    handles = [s.admit(prompt_len=prompt_len, max_output_tokens=32) for _ in range(prompts)]
    firsts: dict[int, int] = {}
    for frame in range(1, 200):
        d.step()
        for i, h in enumerate(handles):
            if i not in firsts and d.trace.first_output_ns(h) is not None:
                firsts[i] = frame
        if len(firsts) == prompts:
            return sorted(firsts.values())
    raise AssertionError("not every prompt had a first output in 200 frames")


@pytest.mark.parametrize("prompt_len", [70, 130])
def test_prompts_arriving_together_finish_one_after_another(prompt_len: int) -> None:
    # balanced: every prompt's first chunk runs before the first prompt finishes.
    assert first_output_frames(policy_preset("balanced"), 4, prompt_len)[0] > 4
    # stream-start: the first finishes in its first frame, one more per frame after it.
    assert first_output_frames(policy_preset("stream-start"), 4, prompt_len) == [1, 2, 3, 4]


def test_the_preset_is_balanced_with_the_stream_start_value() -> None:
    assert policy_preset("stream-start") == replace(PolicyConfig(), stream_start_ms=100.0)
    assert all(policy_preset(n).stream_start_ms == 0 for n in ("balanced", "throughput"))


def test_a_negative_horizon_is_refused() -> None:
    with pytest.raises(PolicyConfigError, match="stream_start_ms"):
        PolicyConfig(stream_start_ms=-1.0)
