"""Covers U-14, flare's finish urgency (``finish_age_price``, part of the ``steady``
preset; docs/scheduling-utility.md, *Steady streams*).

With an urgency on prompt tokens alone, prompts that one chunk does not finish share the
device: each waiting prompt's first chunk is worth more than a started prompt's short
tail, so every prompt waits for every other prompt's first chunk before its first
output. Crediting the finishing chunk with the urgency of the tokens before it lets a
started prompt finish first.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import synthetic_catalog as catalog
from synthetic_catalog import MS, Driver, knee_free_costs, measured_scheduler

from policy import LaneRole
from policy.config import PolicyConfig, policy_preset
from policy.prompt_prices import first_output_values

SHAPES = (*(catalog.prefill(c) for c in (64, 256)), *(catalog.decode(b) for b in (1, 2, 4)),
          catalog.mixed(2, 64), catalog.mixed(4, 64), catalog.mixed(4, 128))
PROMPTS = 4
PROMPT_LEN = 70
"""Longer than the smallest chunk: each prompt needs a 64-token chunk and a tail."""
ADMITTED_MS = 100


cpu_like_ns = knee_free_costs(prefill_ms=5.0, decode_ms=4.0, mixed_token_ms=0.05)
"""Where the smallest chunk is the best prompt tokens per ms, as on the CPU backend."""


def prompts_arriving_together(config: PolicyConfig) -> tuple[Driver, list[int]]:
    """Four 70-token prompts that arrived 1 ms apart, 10 to 7 ms before admission, with
    nothing decoding; run until each has its first output."""
    s = measured_scheduler(SHAPES, config, durations=cpu_like_ns)
    d = Driver(s, durations=cpu_like_ns)
    s.advance_to(ADMITTED_MS * MS)
    handles = [s.admit(prompt_len=PROMPT_LEN, max_output_tokens=4,
                       arrived_ns=s.now_ns - (10 - i) * MS) for i in range(PROMPTS)]
    for _ in range(40):
        assert d.step() is not None
        if all(d.trace.first_output_ns(h) is not None for h in handles):
            return d, handles
    raise AssertionError("a prompt had no first output in 40 frames")


def prompt_order(d: Driver) -> list[int]:
    """The request of each frame's prompt lane, in frame order."""
    return [lane.handle for p in d.trace.plans for lane in p.lanes
            if lane.role is LaneRole.PROMPT]


def first_outputs_ms(d: Driver, handles: list[int]) -> list[float]:
    """Each prompt's first output, ms after admission."""
    return [(d.trace.first_output_ns(h) or 0) / MS - ADMITTED_MS for h in handles]


def test_a_started_prompt_finishes_before_the_next_one_starts() -> None:
    d, handles = prompts_arriving_together(policy_preset("steady"))
    # Chunk then tail, one prompt after the other, oldest first.
    assert prompt_order(d) == [h for h in handles for _ in range(2)]
    assert first_outputs_ms(d, handles) == sorted(first_outputs_ms(d, handles))


def test_without_it_every_prompt_waits_for_every_first_chunk() -> None:
    steady = policy_preset("steady")
    shared, handles = prompts_arriving_together(replace(steady, finish_age_price=0.0))
    assert prompt_order(shared)[:PROMPTS] == handles  # every first chunk before a tail
    ordered, handles = prompts_arriving_together(steady)
    mean = sum(first_outputs_ms(ordered, handles)) / PROMPTS
    assert mean < 0.9 * sum(first_outputs_ms(shared, handles)) / PROMPTS


def test_the_credit_is_the_wait_price_of_the_tokens_before_the_chunk() -> None:
    seed = PolicyConfig()
    one_token = seed.output_token_value + seed.token_fairness / 4.0 + seed.delivery_fairness / 2.0
    assert first_output_values([4.0], [2.0], [30.0], [64], seed, 1.0) == [one_token]
    urgent = replace(seed, finish_age_price=0.5)
    assert first_output_values([4.0], [2.0], [30.0], [64], urgent, 3.0) == [
        pytest.approx(3.0 * one_token + 0.5 * 30.0 * 64)]
    for name in ("balanced", "throughput", "first-token", "stream-start"):
        assert policy_preset(name).finish_age_price == 0.0
