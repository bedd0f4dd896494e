"""``sarathi``: chunked prefill under a token budget with piggybacked decodes.

Covers the baseline ``sarathi``: the budget is never exceeded (logical tokens
and the prompt capacity used), decodes ride with prompt chunks on mixed shapes
(MIX-18), the policy alternates prefill and decode without mixed shapes, and a budget
that cannot fit a prompt next to a full decode batch is refused.
"""

from __future__ import annotations

import pytest
from test_baselines_fcfs import CATALOG, Driver, decode, prefill

from ops.loadgen.workload import LengthSpec
from ops.sim.costs import SyntheticCosts
from ops.sim.engine import SimOptions, simulate
from ops.sim.workloads import WorkloadSpec, build_workload
from policy import Fence, GraphKind, LaneRole, PolicyError, ScheduledPlan, TraceRecord
from policy.baselines import SarathiPolicy
from policy.descriptors import GraphShape


def mixed(b: int, c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=1,
                      prefill_capacity=c, packed_capacity=c + b - 1)


MIXED_CATALOG = (*CATALOG, *(mixed(b, c) for b in (2, 4) for c in (64, 128, 256, 512)))


class Recording(SarathiPolicy):
    """Sarathi that keeps every committed plan."""

    committed: list[ScheduledPlan]

    def commit(self, plan: ScheduledPlan, fence: Fence) -> TraceRecord:
        self.__dict__.setdefault("committed", []).append(plan)
        return super().commit(plan, fence)


def step_tokens(plan: ScheduledPlan) -> int:
    return sum(lane.prompt_tokens + (lane.role is LaneRole.DECODE) for lane in plan.lanes)


@pytest.mark.parametrize(("budget", "catalog"), [(300, MIXED_CATALOG), (200, CATALOG),
                                                  (512, MIXED_CATALOG)])
def test_sarathi_never_exceeds_its_budget(budget: int, catalog: tuple[GraphShape, ...]) -> None:
    policy = Recording(catalog=catalog, token_budget=budget)
    reqs = build_workload(WorkloadSpec(count=30, rate=50.0, seed=1, lengths=LengthSpec(
        kind="uniform", prompt_min=1, prompt_max=2000, output_min=1, output_max=20)))
    result = simulate(policy, reqs, SyntheticCosts().table(catalog), SimOptions())
    assert result.unfinished == 0
    assert len(policy.committed) > 30
    for plan in policy.committed:
        decoders = sum(lane.role is LaneRole.DECODE for lane in plan.lanes)
        assert step_tokens(plan) <= budget
        capacity = plan.shape.prefill_capacity or (
            plan.shape.token_capacity if plan.shape.kind is GraphKind.PREFILL else 0)
        assert capacity + decoders <= budget


def test_sarathi_piggybacks_every_decoder_on_a_mixed_prompt_chunk() -> None:
    p = SarathiPolicy(catalog=MIXED_CATALOG, token_budget=300)
    a = p.admit(prompt_len=10, max_output_tokens=50)
    b = p.admit(prompt_len=10, max_output_tokens=50)
    d = Driver(p)
    d.step()  # a's prompt (no decoders yet): plain prefill
    plan = d.step()  # b's prompt rides with a's decode
    assert plan.shape == mixed(2, 64)
    assert plan.step.mixed is not None and plan.step.mixed.prefill_row == 0
    assert [(lane.handle, lane.role) for lane in plan.lanes] == [
        (b, LaneRole.PROMPT), (a, LaneRole.DECODE)]
    c = p.admit(prompt_len=1000, max_output_tokens=5)
    plan = d.step()
    # Room is 300 - 2 decoders: the largest mixed prompt capacity within it is 256.
    assert plan.shape == mixed(4, 256)
    assert plan.lanes[0].handle == c and plan.lanes[0].prompt_tokens == 256
    assert len(plan.lanes) == 3


def test_sarathi_alternates_prefill_and_decode_without_mixed_programs() -> None:
    p = SarathiPolicy(catalog=CATALOG, token_budget=256)
    p.admit(prompt_len=10, max_output_tokens=50)
    p.admit(prompt_len=1000, max_output_tokens=50)
    d = Driver(p)
    kinds = [d.step().shape.kind for _ in range(7)]
    P, D = GraphKind.PREFILL, GraphKind.DECODE
    assert kinds == [P, D, P, D, P, D, P]
    assert [pl.lanes[0].prompt_tokens for pl in d.plans if pl.shape.kind is P] == [
        10, 256, 256, 256]


def test_sarathi_refuses_a_budget_without_room_for_a_prompt_and_a_full_batch() -> None:
    with pytest.raises(PolicyError, match="token budget"):
        SarathiPolicy(catalog=MIXED_CATALOG, token_budget=64 + 2)
    assert SarathiPolicy(catalog=MIXED_CATALOG, token_budget=64 + 3).token_budget == 67
    assert decode(1) in SarathiPolicy(catalog=CATALOG, token_budget=64).catalog
    assert prefill(64) in SarathiPolicy(catalog=CATALOG, token_budget=64).catalog
