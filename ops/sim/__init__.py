"""``flare sim``: a discrete-event simulator that drives the real policy code.

``costs`` holds cost tables (the linear synthetic model or ``flare bench programs
--json``), ``roofline`` the roofline model of a named model and accelerator,
``workloads`` the simulated traffic, ``engine`` the event loop, ``runs`` the
multi-policy driver that writes JSON and plots with the load benchmark's metrics, and
``capacity``/``capacity_report`` the capacity-at-an-SLO search of ``flare sim-capacity``.
"""

from ops.sim.costs import CostTable, CostTableError, SyntheticCosts, load_bench_programs
from ops.sim.engine import SimOptions, SimResult, SimulationError, simulate
from ops.sim.workloads import SCENARIOS, WorkloadSpec, build_workload, scenario

__all__ = [
    "SCENARIOS",
    "CostTable",
    "CostTableError",
    "SimOptions",
    "SimResult",
    "SimulationError",
    "SyntheticCosts",
    "WorkloadSpec",
    "build_workload",
    "load_bench_programs",
    "scenario",
    "simulate",
]
