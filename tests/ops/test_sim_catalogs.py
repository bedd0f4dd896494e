"""The simulator's catalogs are the ones ``flare run`` loads: no state-operation programs
unless asked (``RuntimeConfig.state_operations`` is off in ``flare run``), so by default
the seed's scheduler plans no terminal capture and a finished request is released at
once; with ``--state-operations`` it ends completions with a terminal snapshot frame
(PRE-38, PRE-41) as a server configured that way does."""

from __future__ import annotations

import argparse

import pytest

from actors.config import RuntimeConfig
from ops import sim_capacity, sim_command
from ops.loadgen.workload import LengthSpec
from ops.sim.catalogs import build_catalogs
from ops.sim.costs import SyntheticCosts
from ops.sim.engine import SimOptions, simulate
from ops.sim.workloads import WorkloadSpec, build_workload
from policy.baselines import make_policy
from policy.descriptors import GraphKind


def _states(shapes: tuple) -> list:
    return [s for s in shapes if s.kind is GraphKind.STATE]


@pytest.mark.parametrize("state_operations", [False, True])
def test_state_programs_only_when_asked(state_operations: bool) -> None:
    catalogs = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=True,
                              draft_depth=2, state_operations=state_operations)
    for shapes in (catalogs.ordinary, catalogs.speculative, catalogs.fixed_width):
        assert bool(_states(shapes)) is state_operations


def test_the_default_follows_flare_run() -> None:
    default = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=True,
                             draft_depth=2)
    assert RuntimeConfig().state_operations is False
    for shapes in (default.ordinary, default.speculative, default.fixed_width):
        assert _states(shapes) == []


@pytest.mark.parametrize("state_operations", [False, True])
def test_terminal_captures_follow_the_catalog(state_operations: bool) -> None:
    """The seed's scheduler on the same load: snapshot frames, one per completion its
    allowance pays for, only on a catalog with state operations."""
    catalogs = build_catalogs(max_batch=4, prefill_capacities=(64, 256), mixed_prefill=True,
                              draft_depth=0, state_operations=state_operations)
    requests = build_workload(WorkloadSpec(count=12, rate=50.0, lengths=LengthSpec(
        kind="fixed", prompt_tokens=256, output_tokens=64)))
    planner = make_policy("balanced", catalog=catalogs.ordinary)
    result = simulate(planner, requests, SyntheticCosts().table(catalogs.ordinary),
                      SimOptions(max_resident=4))
    assert all(r.status == "ok" for r in result.records)
    snapshots = result.frames.get(GraphKind.STATE.value, 0)
    if state_operations:
        assert 0 < snapshots <= len(requests)
    else:
        assert snapshots == 0


@pytest.mark.parametrize("module", [sim_command, sim_capacity])
def test_both_commands_take_the_flag(module) -> None:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    assert parser.parse_args([]).state_operations is False
    assert parser.parse_args(["--state-operations"]).state_operations is True
