"""Scenario runs of the production scheduler on the measured synthetic catalog
(seed *Verification*, ordinary execution; OPEN-33). Each run is driven frame by frame
through plan/commit/complete/publish by ``synthetic_catalog.Driver``."""

from __future__ import annotations

import itertools

import pytest
from synthetic_catalog import (
    MS,
    Driver,
    decode,
    measured_scheduler,
    ordinary_catalog,
    prefill,
)

from policy import GraphKind, LaneRole, Phase, RequestHandle, Scheduler
from policy.config import policy_preset


def max_gap_ms(times: list[int]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0) / MS


def run_until_released(d: Driver, handles: list[RequestHandle], limit: int) -> None:
    for _ in range(limit):
        if not any(h in d.sched.handles() for h in handles):
            return
        if d.step() is None:
            d.sched.advance_to(d.sched.now_ns + MS)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("count", [1, 2, 16])
def test_ver_2_long_prefills_complete_with_full_chunks(count: int) -> None:
    """Covers VER-2, SEL-47: with no decoders every non-tail chunk is a full 4096."""
    s = measured_scheduler(ordinary_catalog())
    handles = [s.admit(prompt_len=10_000, max_output_tokens=2) for _ in range(count)]
    d = Driver(s)
    run_until_released(d, handles, 2000)
    for h in handles:
        assert d.trace.first_output_ns(h) is not None
    first_chunks = [p for p in d.trace.plans if p.shape.kind is GraphKind.PREFILL
                    and p.lanes[0].prompt_start == 0]
    assert len(first_chunks) == count
    if count == 1:
        assert all(p.shape == prefill(4096) for p in first_chunks)


def test_ver_7_long_decode_pair_progresses_evenly() -> None:
    """Covers VER-7, CAT-2: two streams sharing a batch-one decoder alternate."""
    s = measured_scheduler((prefill(64), decode(1)))
    a, b = (s.admit(prompt_len=64, max_output_tokens=400) for _ in range(2))
    d = Driver(s)
    for _ in range(300):
        d.step()
        ra, rb = s.request(a), s.request(b)
        if ra.phase is Phase.DECODE and rb.phase is Phase.DECODE:
            assert abs(ra.output_committed - rb.output_committed) <= 8
    assert s.request(a).output_committed > 100 and s.request(b).output_committed > 100


def contention_run(s: Scheduler, steps: int) -> tuple[Driver, list[RequestHandle], RequestHandle]:
    decoders = [s.admit(prompt_len=64, max_output_tokens=10_000) for _ in range(4)]
    d = Driver(s)
    while any(s.phase(h) is Phase.PREFILL for h in decoders):
        d.step()
    long_prompt = s.admit(prompt_len=40_000, max_output_tokens=4)
    d.run(steps)
    return d, decoders, long_prompt


def test_ver_8_prefill_decode_contention() -> None:
    """Covers VER-8, SEL-48: decoders keep bounded gaps while a 40k prompt progresses."""
    s = measured_scheduler(ordinary_catalog())
    d, decoders, long_prompt = contention_run(s, 600)
    assert d.trace.first_output_ns(long_prompt) is not None  # the prompt finished
    start = d.trace.output_times(decoders[0])[0]
    for h in decoders:
        times = [t for t in d.trace.output_times(h) if t >= start]
        assert max_gap_ms(times) < 150.0  # about two nonpreemptible prefill chunks
    prefill_plans = [p for p in d.trace.plans if p.shape.kind is GraphKind.PREFILL]
    full = [p for p in prefill_plans if p.shape.token_capacity == 4096]
    assert prefill_plans and len(full) < len(prefill_plans) / 2  # mostly smaller chunks


def test_ver_10_output_gaps_follow_the_age_tradeoff() -> None:
    """Covers VER-10, POL-6: the balanced preset keeps decoder gaps shorter than the
    throughput preset (no age price), which favours large prefill chunks."""
    gaps = {}
    for name in ("balanced", "throughput"):
        s = measured_scheduler(ordinary_catalog(), policy_preset(name))
        d, decoders, _ = contention_run(s, 400)
        gaps[name] = max(max_gap_ms(d.trace.output_times(h)[1:]) for h in decoders)
    assert gaps["balanced"] < gaps["throughput"]


def test_ver_16_mixed_concurrent_prompt_and_decode() -> None:
    """Covers VER-16, MIX-27, MIX-28: prompts and decodes both progress in mixed frames."""
    s = measured_scheduler(ordinary_catalog(with_mixed=True))
    decoders = [s.admit(prompt_len=64, max_output_tokens=10_000) for _ in range(3)]
    d = Driver(s)
    while any(s.phase(h) is Phase.PREFILL for h in decoders):
        d.step()
    prompts = [s.admit(prompt_len=900, max_output_tokens=3) for _ in range(3)]
    d.run(300)
    assert all(d.trace.first_output_ns(h) is not None for h in prompts)
    mixed_with_prompt = [p for p in d.trace.plans if p.shape.kind is GraphKind.MIXED
                         and p.step.mixed is not None and p.step.mixed.prefill_row == 0]
    assert mixed_with_prompt
    for p in mixed_with_prompt:
        roles = [lane.role for lane in p.lanes]
        assert roles[0] is LaneRole.PROMPT and set(roles[1:]) <= {LaneRole.DECODE}
    assert all(s.request(h).output_committed > 20 for h in decoders)


def sixteen_short_prompts() -> tuple[Scheduler, Driver, list[RequestHandle]]:
    s = measured_scheduler(ordinary_catalog())
    handles = [s.admit(prompt_len=64, max_output_tokens=10_000) for _ in range(16)]
    d = Driver(s)
    d.run(100)
    return s, d, handles


def test_ver_25_sixteen_short_prompts_gaps_below_150_ms() -> None:
    """Covers VER-25 for ordinary execution: once a stream delivers, its later gaps stay
    below 150 ms."""
    _, d, handles = sixteen_short_prompts()
    for h in handles:
        assert d.trace.first_output_ns(h) is not None
        assert max_gap_ms(d.trace.output_times(h)) < 150


def test_ver_24_26_sixteen_short_prompts_first_output_and_spread() -> None:
    """Covers VER-24, VER-26 for ordinary execution: each 64-token prompt delivers its
    first output within 100 ms; after another hundred rounds every stream progressed
    with a spread of at most one eight-token burst."""
    s, d, handles = sixteen_short_prompts()
    for h in handles:
        first = d.trace.first_output_ns(h)
        assert first is not None and first / MS <= 100
    d.run(100)
    counts = [s.request(h).output_committed for h in handles]
    assert min(counts) > 0 and max(counts) - min(counts) <= 8
