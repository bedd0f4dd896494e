"""The simulator's admission orders (``ops.sim.admission``): FIFO, and least slack under
one TTFT target for every request (by arrival minus pure prefill time)."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from ops import sim_command
from ops.loadgen.workload import RequestPlan
from ops.sim.admission import AdmissionQueue
from ops.sim.costs import CostTable
from ops.sim.engine import SimOptions, simulate
from policy.baselines import make_policy
from policy.descriptors import GraphKind, GraphShape

MS = 1_000_000
PREFILL_64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
PREFILL_256 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=256)
DECODE_1 = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1,
                      packed_capacity=1)
COSTS = CostTable({PREFILL_64: 10 * MS, PREFILL_256: 30 * MS, DECODE_1: 5 * MS},
                  source="test")


def one(prompt: int, output: int, at_s: float, index: int) -> RequestPlan:
    return RequestPlan(index=index, client="default", arrival_s=at_s, prompt_tokens=prompt,
                       output_tokens=output)


def test_fifo_pops_in_arrival_order_whatever_the_prompt() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue("fifo", COSTS)
    queue.append("short", arrival_ns=1 * MS, prompt_tokens=10)
    queue.append("long", arrival_ns=2 * MS, prompt_tokens=1000)
    assert len(queue) == 2
    assert [queue.pop(), queue.pop()] == ["short", "long"]


def test_least_slack_orders_by_arrival_minus_pure_prefill() -> None:
    """Pure prefill, the fastest single shape: 10 tokens 10 ms; 300 tokens 50 ms
    (five 64-chunks; two 256-chunks are 60 ms). Keys: short at 1 ms -> -9 ms; long at
    30 ms -> -20 ms (first); long at 45 ms -> -5 ms (after the short ones); equal
    keys keep their arrival order."""
    queue: AdmissionQueue[str] = AdmissionQueue("least-slack", COSTS)
    queue.append("short", arrival_ns=1 * MS, prompt_tokens=10)
    queue.append("late long", arrival_ns=45 * MS, prompt_tokens=300)
    queue.append("long", arrival_ns=30 * MS, prompt_tokens=300)
    queue.append("second short", arrival_ns=1 * MS, prompt_tokens=10)
    assert [queue.pop() for _ in range(4)] == ["long", "short", "second short", "late long"]


def test_an_unknown_order_or_a_catalog_without_prefill_is_refused() -> None:
    with pytest.raises(ValueError, match="fifo, least-slack"):
        AdmissionQueue("shortest-first", COSTS)
    queue: AdmissionQueue[str] = AdmissionQueue(
        "least-slack", CostTable({DECODE_1: 5 * MS}, source="test"))
    with pytest.raises(ValueError, match="no prefill shape"):
        queue.append("x", arrival_ns=0, prompt_tokens=10)


@pytest.mark.parametrize(("order", "long_arrival_s", "long_first"), [
    ("fifo", 0.025, False), ("least-slack", 0.025, True), ("least-slack", 0.045, False)])
def test_the_simulator_admits_in_the_chosen_order(order: str, long_arrival_s: float,
                                                  long_first: bool) -> None:
    """One row, held by A until its 20 tokens end (past 100 ms); the short prompt B
    arrives at 1 ms, the 300-token prompt C later. Least slack admits C first when
    it arrives less than its 40 ms more prefill after B (25 ms), not at 45 ms."""
    planner = make_policy("fcfs", catalog=(PREFILL_64, DECODE_1))
    reqs = [one(10, 20, 0.0, 0), one(10, 2, 0.001, 1), one(300, 2, long_arrival_s, 2)]
    result = simulate(planner, reqs, COSTS, SimOptions(dispatch_ns=0, output_limit=0,
                                                       max_resident=1, admission=order))
    _, short, long = result.records
    assert all(r.status == "ok" for r in result.records)
    assert (long.chunk_times_s[0] < short.chunk_times_s[0]) is long_first
    assert result.records[0].finished_s < min(short.chunk_times_s[0], long.chunk_times_s[0])


def test_sim_writes_the_admission_order(tmp_path: pathlib.Path) -> None:
    parser = argparse.ArgumentParser()
    sim_command.add_arguments(parser)
    out = tmp_path / "run"
    assert sim_command.main(parser.parse_args([
        "--num-requests", "4", "--max-batch", "4", "--prefill-capacity", "64",
        "--policy", "fcfs", "--admission-order", "least-slack", "--output-dir", str(out),
        "--no-plots"])) == 0
    data = json.loads((out / "sim.json").read_text())
    assert data["options"]["admission"] == "least-slack"
    assert data["config"]["admission"] == "least-slack"
    with pytest.raises(SystemExit):
        parser.parse_args(["--admission-order", "random"])
