"""``vtc``: virtual token counters across clients on top of chunked prefill.

Covers the baseline ``vtc``: counters charge input tokens at weight 1 and output
tokens at weight 2; a newly backlogged client is lifted to the minimum counter of the
backlogged clients (never lowered); backlogged clients' counters stay within
``counter_bound()`` through a flooded two-client run; and a light client is served
ahead of a flooding client's backlog where ``fcfs`` serves it last.
"""

from __future__ import annotations

import pytest
from test_baselines_fcfs import CATALOG, Driver
from test_baselines_sarathi import MIXED_CATALOG

from ops.loadgen.workload import RequestPlan
from ops.sim.costs import SyntheticCosts
from ops.sim.engine import SimOptions, simulate
from policy import CompletionRecord, ExecutionTiming, Fence, GeneratedToken, Phase
from policy.baselines import FcfsPolicy, VtcPolicy, make_policy
from policy.protocol import SchedulingPolicy


def tagged(p: VtcPolicy, client: str, prompt: int, output: int) -> int:
    h = p.admit(prompt_len=prompt, max_output_tokens=output)
    p.assign_client(h, client)
    return h


def test_vtc_counts_input_once_and_output_twice() -> None:
    p = VtcPolicy(catalog=CATALOG, token_budget=256)
    tagged(p, "a", 100, 3)
    d = Driver(p)
    for _ in range(3):
        d.step()
    # 100 prompt tokens + 3 outputs (the first comes with the prompt) = 100 + 6.
    assert p.counters()["a"] == pytest.approx(106.0)


def test_vtc_lifts_a_newly_backlogged_client_to_the_backlogged_minimum() -> None:
    p = VtcPolicy(catalog=CATALOG, token_budget=256)
    tagged(p, "a", 200, 50)
    tagged(p, "c", 40, 50)
    d = Driver(p)
    for _ in range(4):
        d.step()
    before = p.counters()
    floor = min(before["a"], before["c"])
    assert floor > 0
    tagged(p, "b", 10, 5)
    assert p.counters()["b"] == floor
    # A client that is already backlogged is not lifted again; one above the floor is
    # never lowered.
    tagged(p, "b", 10, 5)
    assert p.counters()["b"] == floor


def test_vtc_never_lowers_a_returning_clients_counter() -> None:
    p = VtcPolicy(catalog=CATALOG, token_budget=256)
    tagged(p, "big", 500, 2)
    d = Driver(p)
    while p.plan() is not None:
        d.step()
    high = p.counters()["big"]
    p.take_released()
    tagged(p, "small", 10, 100)
    d.step()
    tagged(p, "big", 10, 2)  # newly backlogged again, already above the floor
    assert p.counters()["big"] == high


class Checked(VtcPolicy):
    """VTC that checks the counter bound after every completion."""

    worst_spread: float = 0.0

    def complete(self, fence: Fence, records: list[CompletionRecord],  # type: ignore[override]
                 timing: ExecutionTiming) -> list[GeneratedToken]:
        out = super().complete(fence, records, timing)
        counters = self.counters()
        backlog = [counters.get(c, 0.0) for c in self.backlogged_clients()]
        if len(backlog) > 1:
            spread = max(backlog) - min(backlog)
            self.worst_spread = max(self.worst_spread, spread)
            assert spread <= self.counter_bound()
        return out


def flood(light_at: float = 0.05) -> list[RequestPlan]:
    heavy = [RequestPlan(index=i, client="heavy", arrival_s=0.0, prompt_tokens=300,
                         output_tokens=40) for i in range(40)]
    light = [RequestPlan(index=40 + i, client="light", arrival_s=light_at + 0.2 * i,
                         prompt_tokens=60, output_tokens=40) for i in range(6)]
    return heavy + light


def test_vtc_keeps_backlogged_counters_within_its_bound() -> None:
    """max_tokens equal to each length keeps the bound tight: 2 * 4 running * (300 +
    2 * 40) = 3040 weighted tokens, while the flooded run reaches a spread above half
    of it."""
    p = Checked(catalog=MIXED_CATALOG, token_budget=256)
    result = simulate(p, flood(), SyntheticCosts().table(MIXED_CATALOG),
                      SimOptions(output_limit=0))
    assert result.unfinished == 0
    assert p.counter_bound() == 3040
    assert p.worst_spread > p.counter_bound() / 2


def _light_ttft(policy: SchedulingPolicy) -> float:
    result = simulate(policy, flood(), SyntheticCosts().table(MIXED_CATALOG), SimOptions())
    ttfts = [r.ttft_s for r in result.records if r.client == "light"]
    assert all(t is not None for t in ttfts)
    return sum(t for t in ttfts if t is not None) / len(ttfts)


def test_vtc_serves_a_light_client_ahead_of_a_flooding_clients_backlog() -> None:
    vtc = _light_ttft(VtcPolicy(catalog=MIXED_CATALOG, token_budget=256))
    fcfs = _light_ttft(FcfsPolicy(catalog=MIXED_CATALOG))
    assert vtc < fcfs / 3


def test_every_policy_takes_client_tags_and_vtc_keeps_them() -> None:
    vtc = make_policy("vtc", catalog=CATALOG)
    assert isinstance(vtc, VtcPolicy)
    h = vtc.admit(prompt_len=8, max_output_tokens=4)
    vtc.assign_client(h, "a")
    assert vtc.client_of(h) == "a"
    seed = make_policy("balanced", catalog=CATALOG)
    h = seed.admit(prompt_len=8, max_output_tokens=4)
    seed.assign_client(h, "a")  # recorded; ranked by client only by client_fairness
    assert seed.phase(h) is Phase.PREFILL
