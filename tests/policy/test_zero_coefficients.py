"""Intrinsic throughput alone is not starvation-free. Covers POL-13: with every fairness
and age coefficient at zero a waiting prompt can starve behind decoders whose intrinsic
value per millisecond is higher; the default coefficients serve it."""

from __future__ import annotations

from decoding import decoding
from synthetic_catalog import Driver, decode, measured_scheduler, prefill

from policy import RequestHandle, Scheduler
from policy.config import PolicyConfig

ZERO = PolicyConfig(token_fairness=0.0, delivery_fairness=0.0, decode_age_price=0.0,
                    terminal_age_price=0.0)


def served_prompt(config: PolicyConfig, steps: int = 200) -> bool:
    s: Scheduler = measured_scheduler((prefill(64), decode(4)), config)
    for _ in range(4):
        decoding(s, prompt_len=8, max_output_tokens=10_000, visible_ago_ns=0)
    waiting: RequestHandle = s.admit(prompt_len=512, max_output_tokens=4)
    trace = Driver(s).run(steps)
    return any(waiting in plan.handles() for plan in trace.plans)


def test_pol_13_zero_coefficients_can_starve_a_prompt() -> None:
    assert not served_prompt(ZERO)
    assert served_prompt(PolicyConfig())
