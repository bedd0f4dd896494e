"""``flare bench speculation --simulate``: the bench's modes on the simulator.

Owns the ``--simulate*`` options and turns ``ops/sim/speculation_sweep.py``'s figures
into the bench's rows, so the table, the medians over ``--repeats`` and both verdict
readings are the measured bench's. The modes are ``off`` (with ``--simulate-off``, its
own cost table: a learned load's decode also runs the draft), each fixed depth, and
adaptive once per ``--adaptive-policies`` preset, labelled with the source ``sim``;
repeat ``r`` draws the acceptance with seed ``r``. Deterministic; no model is loaded.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from gpu.catalog import CatalogError
from ops.bench_speculation_rows import Mode, Row
from ops.sim.catalogs import STATE_OPERATIONS_HELP
from ops.sim.costs import CostTableError, load_bench_programs
from ops.sim.speculation_sweep import (
    SweepLoad,
    SweepMode,
    mode_catalog,
    simulate_mode,
    sweep_catalogs,
)


class SimulationInputError(ValueError):
    """A cost table is missing, unreadable or does not cover a simulated mode."""


def _probability(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"must be finite and non-negative, got {text}")
    return value


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--simulate*`` options of ``flare bench speculation``."""
    sim = parser.add_argument_group(
        "simulated device (ops/sim/speculation_sweep.py): the same modes and loads on "
        "measured program durations, deterministic, no model run")
    sim.add_argument("--simulate", type=Path, default=None, metavar="PROGRAMS_JSON",
                     help="flare bench programs --json of the speculative load (--speculation "
                          "draft --draft-depth <largest depth>, same --max-batch and "
                          "--mixed-prefill): simulate instead of running the model")
    sim.add_argument("--simulate-off", type=Path, default=None, metavar="PROGRAMS_JSON",
                     help="flare bench programs --json without speculation, for the 'off' "
                          "row (omitted without it)")
    sim.add_argument("--simulate-host-ms", type=_non_negative, default=0.0,
                     help="host time added to every simulated frame (on the 2-vCPU CPU "
                          "backend the server's planning and publishing share the core "
                          "with the model: about 2-3 ms per frame; default 0)")
    sim.add_argument("--simulate-state-operations", action="store_true",
                     help=STATE_OPERATIONS_HELP)
    sim.add_argument("--simulate-acceptance", type=_probability, default=0.8,
                     help="per-token draft acceptance of each simulated request, spread "
                          "by +-0.1 (default 0.8); --repeats N draws N acceptance seeds")


def simulated_modes(args: argparse.Namespace) -> list[Mode]:
    """``--simulate``'s modes: ``off`` (with ``--simulate-off``), each fixed depth and
    adaptive per preset, under the source label ``sim``."""
    depths = [int(d) for d in args.depths.split(",") if d]
    presets: list[str | None] = list(args.adaptive_policies) or [None]
    modes = [Mode("off", "-", 0)] if args.simulate_off is not None else []
    modes += [Mode("fixed", "sim", d) for d in depths]
    return modes + [Mode("adaptive", "sim", max(depths), policy=p) for p in presets]


def simulated_rows(args: argparse.Namespace) -> list[Row]:
    """``--simulate``: every mode and load on the simulated device; repeat ``r`` draws
    the acceptance with seed ``r``."""
    depths = [int(d) for d in args.depths.split(",") if d]
    try:
        catalogs = sweep_catalogs(max_batch=args.max_batch, mixed_prefill=args.mixed_prefill,
                                  depths=depths,
                                  state_operations=args.simulate_state_operations)
    except CatalogError as exc:
        raise SimulationInputError(str(exc)) from exc
    modes = {m: SweepMode(m.speculation, m.depth, m.policy or args.scheduler_policy)
             for m in simulated_modes(args)}
    speculative = {s for m in modes.values() if m.speculation != "off"
                   for s in mode_catalog(m, catalogs)}
    host_ns = round(args.simulate_host_ms * 1e6)
    try:
        costs = load_bench_programs(args.simulate, speculative).plus(host_ns)
        # a learned load's decode also runs the draft: "off" has its own table
        off_costs = (load_bench_programs(args.simulate_off, catalogs[0].ordinary).plus(host_ns)
                     if args.simulate_off is not None else costs)
    except (CostTableError, OSError, ValueError) as exc:
        raise SimulationInputError(str(exc)) from exc
    rows = []
    for repeat in range(max(args.repeats, 1)):
        for mode, sweep in modes.items():
            for streams in (int(n) for n in args.loads.split(",") if n):
                load = SweepLoad(streams=streams, requests_per_stream=args.requests_per_stream,
                                 warm_up_requests=args.warm_up_requests,
                                 prompt_tokens=args.prompt_tokens,
                                 output_tokens=args.max_tokens,
                                 acceptance=args.simulate_acceptance, seed=repeat)
                f = simulate_mode(sweep, load, catalogs=catalogs,
                                  costs=off_costs if sweep.speculation == "off" else costs)
                rows.append(Row(mode.label(), streams, f.tokens, f.seconds,
                                f.tokens / f.seconds if f.seconds > 0 else 0.0,
                                f.mean_itl_ms, acceptance=f.acceptance,
                                speculative_share=f.speculative_share,
                                mean_gap_ms=f.mean_gap_ms, repeat=repeat))
    return rows
