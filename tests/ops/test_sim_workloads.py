"""Simulated workloads: scenarios, long-prompt interference, clients, determinism.

Covers the simulator's workloads: a long prompt every N seconds from client
``long`` over the chat traffic, unequal client demand, named scenarios with overrides,
and identical plans for identical seeds.
"""

from __future__ import annotations

import itertools

import pytest

from ops.loadgen.workload import ClientSpec, LengthSpec
from ops.sim.workloads import LONG_CLIENT, SCENARIOS, WorkloadSpec, build_workload, scenario


def test_long_prompts_every_n_seconds_over_chat_traffic() -> None:
    spec = WorkloadSpec(count=200, rate=10.0, seed=4, long_prompt_every_s=3.0,
                        long_prompt_tokens=5000, long_output_tokens=7)
    plans = build_workload(spec)
    long = [p for p in plans if p.client == LONG_CLIENT]
    chat = [p for p in plans if p.client != LONG_CLIENT]
    assert len(chat) == 200
    last = max(p.arrival_s for p in chat)
    assert [p.arrival_s for p in long] == pytest.approx(
        [3.0 * k for k in range(1, int(last // 3.0) + 1)])
    assert {(p.prompt_tokens, p.output_tokens) for p in long} == {(5000, 7)}
    assert [p.index for p in plans] == list(range(len(plans)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(plans))


def test_clients_with_unequal_demand_and_seeded_determinism() -> None:
    spec = WorkloadSpec(count=400, rate=20.0, seed=9,
                        clients=(ClientSpec(name="a", weight=3.0), ClientSpec(name="b")),
                        lengths=LengthSpec(kind="sharegpt"))
    plans = build_workload(spec)
    share = sum(p.client == "a" for p in plans) / len(plans)
    assert 0.65 < share < 0.85
    assert build_workload(spec) == plans
    assert build_workload(scenario("poisson", seed=10)) != build_workload(scenario("poisson"))


def test_scenarios_and_overrides() -> None:
    assert set(SCENARIOS) >= {"interference", "bursty", "fairness", "poisson"}
    assert SCENARIOS["interference"].long_prompt_every_s is not None
    assert SCENARIOS["bursty"].arrivals == "gamma" and SCENARIOS["bursty"].burstiness < 1
    assert len(SCENARIOS["fairness"].clients) == 2
    spec = scenario("bursty", count=12, rate=None)
    assert spec.count == 12 and spec.rate == SCENARIOS["bursty"].rate
    with pytest.raises(ValueError, match="unknown scenario"):
        scenario("nope")
