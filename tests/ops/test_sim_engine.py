"""The simulator's accounting on hand-computed cases, determinism, and a smoke run.

Covers the simulator: exact TTFT/finish times from known costs, the two-slot
window (QUEUE-10, QUEUE-11: decode queues behind decode and hides the dispatch gap;
prefill drains the window), EOS-terminated requests whose queued decode is discarded,
admission limited by resident slots with release after the terminal snapshot (PRE-41),
determinism for a seed, and every policy finishing every request.
"""

from __future__ import annotations

from typing import Any

import pytest

from ops.loadgen.workload import LengthSpec, RequestPlan
from ops.sim.costs import CostTable, SyntheticCosts
from ops.sim.engine import SimOptions, simulate
from ops.sim.workloads import WorkloadSpec, build_workload
from policy.baselines import POLICY_NAMES, make_policy
from policy.descriptors import GraphKind, GraphShape, StateOp
from policy.requests import RequestHandle
from policy.scheduler import Scheduler

MS = 1_000_000
PREFILL_64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
DECODE_1 = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1,
                      packed_capacity=1)
DECODE_2 = GraphShape(kind=GraphKind.DECODE, batch_capacity=2, token_capacity=1,
                      packed_capacity=2)
SNAPSHOT = GraphShape(kind=GraphKind.STATE, batch_capacity=1, token_capacity=0,
                      state_op=StateOp.SNAPSHOT)
TINY_COSTS = CostTable({PREFILL_64: 10 * MS, DECODE_1: 5 * MS, DECODE_2: 6 * MS,
                        SNAPSHOT: 2 * MS}, source="test")


def one(prompt: int, output: int, at_s: float, index: int = 0,
        client: str = "default") -> RequestPlan:
    return RequestPlan(index=index, client=client, arrival_s=at_s, prompt_tokens=prompt,
                       output_tokens=output)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_one_request_exact_times_by_length(policy: str) -> None:
    """Prefill 10 ms then two queued 5 ms decodes; 1 ms dispatch gap only before frames
    committed into an empty window: tokens at 1.011, 1.017 (1.011 + 1 + 5), 1.022
    (queued: starts when the first decode ends)."""
    catalog = (PREFILL_64, DECODE_1)
    planner = make_policy(policy, catalog=catalog)
    result = simulate(planner, [one(50, 3, 1.0)], TINY_COSTS,
                      SimOptions(dispatch_ns=1 * MS, output_limit=0))
    (rec,) = result.records
    assert rec.status == "ok" and rec.finish_reason == "length"
    assert rec.chunk_times_s == pytest.approx((1.011, 1.017, 1.022), abs=1e-12)
    assert rec.chunk_tokens == (1.0, 1.0, 1.0)
    assert rec.ttft_s == pytest.approx(0.011)
    assert rec.finished_s == pytest.approx(1.022)
    assert result.frames == {"decode": 2, "prefill": 1}
    assert result.busy_s == pytest.approx(0.020)
    assert result.padding == {"rows": 0.0, "prompt_tokens": pytest.approx(14 / 64)}


@pytest.mark.parametrize("policy", ["balanced", "fcfs", "sarathi"])
def test_eos_request_discards_the_decode_queued_behind_its_last_token(policy: str) -> None:
    """With max_tokens above the target the request ends by EOS at its third token
    (1.022); the decode already queued behind it runs (ends 1.027) and is discarded."""
    planner = make_policy(policy, catalog=(PREFILL_64, DECODE_1))
    result = simulate(planner, [one(50, 3, 1.0)], TINY_COSTS,
                      SimOptions(dispatch_ns=1 * MS, output_limit=100))
    (rec,) = result.records
    assert rec.finish_reason == "stop"
    assert rec.finished_s == pytest.approx(1.022)
    assert rec.output_tokens == 3
    assert result.frames == {"decode": 3, "prefill": 1}
    assert result.makespan_s == pytest.approx(1.027)


def test_resident_limit_and_release_after_terminal_snapshot() -> None:
    """max_resident 1: the second request (arrived at 0) is admitted only when the first
    is released by its 2 ms snapshot: A prefill 0-10, decode 10-15 (finishes),
    snapshot 15-17; B prefill 17-27, decode 27-32, snapshot 32-34. No dispatch gap."""
    planner = make_policy("fcfs", catalog=(PREFILL_64, DECODE_1, SNAPSHOT))
    result = simulate(planner, [one(10, 2, 0.0, 0), one(10, 2, 0.0, 1)], TINY_COSTS,
                      SimOptions(dispatch_ns=0, output_limit=0, max_resident=1))
    a, b = result.records
    assert a.chunk_times_s == pytest.approx((0.010, 0.015))
    assert b.chunk_times_s == pytest.approx((0.027, 0.032))
    assert b.ttft_s == pytest.approx(0.027)
    assert result.frames == {"decode": 2, "prefill": 2, "state": 2}
    assert result.makespan_s == pytest.approx(0.034)
    # Slots held, each request: 10 ms before its first token (B from its admission at
    # 17 ms, not its arrival), 5 ms streaming, 2 ms retiring after its last token.
    assert result.slots == pytest.approx({"prompt": 20 / 34, "streaming": 10 / 34,
                                          "retiring": 4 / 34})


def test_admission_tells_the_scheduler_when_a_queued_request_arrived() -> None:
    """The first-token urgency counts from arrival (``Scheduler.admit``'s
    ``arrived_ns``): B, queued behind A's 15 ms of service, is admitted at 15 ms
    with its arrival at 1 ms."""
    planner = make_policy("first-token", catalog=(PREFILL_64, DECODE_1))
    assert isinstance(planner, Scheduler)
    admit = planner.admit
    seen: list[tuple[int, int | None]] = []

    def spy(**kw: Any) -> RequestHandle:
        h = admit(**kw)
        seen.append((planner.now_ns, planner.request(h).arrived_ns))
        return h

    planner.admit = spy  # type: ignore[method-assign]
    simulate(planner, [one(10, 2, 0.0, 0), one(10, 2, 0.001, 1)], TINY_COSTS,
             SimOptions(dispatch_ns=0, output_limit=0, max_resident=1))
    assert seen == [(0, 0), (15 * MS, 1 * MS)]


def test_queue_limit_refuses_arrivals() -> None:
    planner = make_policy("fcfs", catalog=(PREFILL_64, DECODE_1))
    reqs = [one(10, 2, 0.0, i) for i in range(4)]
    result = simulate(planner, reqs, TINY_COSTS,
                      SimOptions(dispatch_ns=0, output_limit=0, max_resident=1, max_queue=1))
    statuses = [r.status for r in result.records]
    assert statuses == ["ok", "ok", "error", "error"]


def _small_workload(seed: int) -> tuple[RequestPlan, ...]:
    return build_workload(WorkloadSpec(
        count=24, rate=20.0, seed=seed,
        lengths=LengthSpec(kind="uniform", prompt_min=8, prompt_max=700, output_min=1,
                           output_max=24)))


def _catalog() -> tuple[GraphShape, ...]:
    from gpu.catalog import CatalogFlags, build_catalog

    return build_catalog(CatalogFlags(max_batch=4, prefill_capacities=(64, 256),
                                      mixed_prefill=True, family_supports_mixed=True)).shapes


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_finishes_every_request(policy: str) -> None:
    catalog = _catalog()
    reqs = _small_workload(3)
    result = simulate(make_policy(policy, catalog=catalog, token_budget=256), reqs,
                      SyntheticCosts().table(catalog), SimOptions(noise=0.2, seed=3))
    assert result.unfinished == 0
    for plan, rec in zip(reqs, result.records, strict=True):
        assert rec.status == "ok"
        assert rec.output_tokens == plan.output_tokens
        assert rec.ttft_s is not None and rec.ttft_s > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["balanced", "vtc"])
def test_same_seed_same_run_other_seed_other_run(policy: str) -> None:
    catalog = _catalog()
    costs = SyntheticCosts().table(catalog)

    def run(seed: int) -> tuple[object, ...]:
        result = simulate(make_policy(policy, catalog=catalog, token_budget=256),
                          _small_workload(seed), costs, SimOptions(noise=0.3, seed=seed))
        return tuple((r.chunk_times_s, r.finished_s) for r in result.records)

    assert run(5) == run(5)
    assert run(5) != run(6)
