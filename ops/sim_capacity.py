"""``flare sim-capacity``: each scheduling configuration's capacity at an SLO, simulated.

For every configuration (the seed's presets ``balanced``/``throughput``, ``fcfs``,
``vtc`` and ``sarathi`` at token budgets 256/512/1024/2048) and every scenario of the
suite (ShareGPT-like Poisson, bursty, periodic long prompts, unequal tenants, long
outputs), searches the highest Poisson rate at which at least ``--attainment`` of every
client's requests meet ``--ttft`` and ``--tpot`` (``ops.sim.capacity``), all with the
same running limit and cost table. Writes ``capacity.md`` (the table),
``capacity.json`` (every search and the metrics at each capacity) and ``pareto.png``
(TTFT p99 against TPOT p99 of every configuration at one rate per scenario: the best
baseline's capacity, or ``--pareto-rate``). With the long-prompts scenario it also runs
the long-prompt check at ``--long-prompt-rate`` (``ops.sim.long_prompt_check``). See
``docs/simulator.md``, *Capacity*. ``--with-speculation`` adds the seed's presets with
adaptive speculation and the fixed-depth speculation baselines, on the speculative load
of ``--draft-depth`` with every draft accepted at ``--acceptance`` (an assumption: the
simulator has no draft model).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

QUICK_COUNT = 12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.sim.capacity import CAPACITY_SCENARIOS, CONFIGURATIONS, DEFAULT_CONFIGURATIONS
    from ops.sim.catalogs import (
        DEFAULT_DRAFT_DEPTH,
        NO_SPECULATIVE_MIXED_HELP,
        STATE_OPERATIONS_HELP,
    )
    from ops.sim.workloads import DEFAULT_ACCEPTANCE
    from ops.sim_command import add_admission_argument, add_cost_arguments

    labels = tuple(c.label for c in DEFAULT_CONFIGURATIONS)
    sel = parser.add_argument_group("what to compare")
    sel.add_argument("--configuration", nargs="+", choices=tuple(c.label for c in CONFIGURATIONS),
                     default=None, dest="configurations",
                     help=f"default: {' '.join(labels)} (balanced-adapt-*: the seed preset "
                          "with another adaptation time, opt-in)")
    sel.add_argument("--variant", action="append", default=[], metavar="LABEL=PRESET:FIELD=V",
                     help="one more configuration: a preset with PolicyConfig fields "
                          "replaced, e.g. first-token-u0.3=first-token:prompt_age_price=0.3 "
                          "(repeatable; measured, never a baseline)")
    sel.add_argument("--with-speculation", action="store_true",
                     help="also run balanced+spec, throughput+spec (the seed presets with "
                          "adaptive speculation) and fixed-spec-1..D (every decode "
                          "speculates D drafts)")
    sel.add_argument("--scenario", nargs="+", choices=tuple(CAPACITY_SCENARIOS),
                     default=None, dest="scenarios",
                     help=f"default: {' '.join(CAPACITY_SCENARIOS)}")
    slo = parser.add_argument_group("SLO and search")
    slo.add_argument("--ttft", type=float, default=1.0, help="TTFT target (s)")
    slo.add_argument("--tpot", type=float, default=0.05, help="TPOT target (s)")
    slo.add_argument("--attainment", type=float, default=0.9,
                     help="fraction of each client's requests that must meet both targets")
    slo.add_argument("--num-requests", type=int, default=200, dest="count",
                     help="chat requests per simulated run")
    slo.add_argument("--start-rate", type=float, default=2.0)
    slo.add_argument("--rate-min", type=float, default=0.125)
    slo.add_argument("--rate-max", type=float, default=256.0)
    slo.add_argument("--bisections", type=int, default=4)
    slo.add_argument("--pareto-rate", type=float, default=None,
                     help="rate of the Pareto plot's runs (default: per scenario, the best "
                          "baseline's capacity)")
    slo.add_argument("--long-prompt-rate", type=float, default=4.0,
                     help="rate of the long-prompt check (worst long-prompt TTFT against "
                          "its pure prefill time, chat ITL p99 against sarathi's best); "
                          "run when the long-prompts scenario is")
    slo.add_argument("--seed", type=int, default=0)
    slo.add_argument("--quick", action="store_true",
                     help=f"{QUICK_COUNT} requests per run, one bisection (for tests)")
    dev = parser.add_argument_group("simulated server (as flare sim)")
    add_cost_arguments(dev)
    dev.add_argument("--max-batch", type=int, default=16)
    dev.add_argument("--prefill-capacity", type=int, nargs="+", default=[64, 256, 1024],
                     dest="prefill_capacities")
    dev.add_argument("--max-running", type=int, default=None,
                     help="requests resident and running at once, every configuration "
                          "(default: --max-batch)")
    add_admission_argument(dev)
    dev.add_argument("--dispatch-us", type=float, default=50.0)
    dev.add_argument("--draft-depth", type=int, default=DEFAULT_DRAFT_DEPTH,
                     help="proposal depth of the speculative load (speculating "
                          "configurations only)")
    dev.add_argument("--no-speculative-mixed", action="store_false", dest="speculative_mixed",
                     help=NO_SPECULATIVE_MIXED_HELP)
    dev.add_argument("--state-operations", action="store_true",
                     help=STATE_OPERATIONS_HELP)
    dev.add_argument("--acceptance", type=float, default=DEFAULT_ACCEPTANCE,
                     help="probability that the target accepts each drafted token "
                          "(speculating configurations only)")
    dev.add_argument("--acceptance-spread", type=float, default=0.1,
                     help="each request's acceptance drawn uniformly within +/- this")
    out = parser.add_argument_group("output")
    out.add_argument("--jobs", type=int, default=1, help="simulations run in parallel")
    out.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("sim-capacity"))
    out.add_argument("--no-plots", action="store_true")


def _capacity_task(task: tuple[Any, str, Any, Any]) -> dict[str, Any]:
    from ops.sim.capacity import capacity_of

    config, scenario, setup, settings = task
    return capacity_of(config, scenario, setup, settings)


def _rate_task(task: tuple[Any, str, float, Any]) -> dict[str, Any]:
    from ops.sim.capacity import CAPACITY_SCENARIOS, simulate_rate
    from ops.sim.workloads import SCENARIOS

    config, scenario, rate, setup = task
    run = simulate_rate(config, SCENARIOS[CAPACITY_SCENARIOS[scenario]], rate, setup)
    return {**run, "configuration": config.label, "scenario": scenario}


def _chat_alone_task(task: tuple[Any, float, Any]) -> dict[str, Any]:
    """The long-prompt scenario's chat traffic without its long prompts."""
    from dataclasses import replace

    from ops.sim.capacity import CAPACITY_SCENARIOS, simulate_rate
    from ops.sim.workloads import SCENARIOS

    config, rate, setup = task
    spec = replace(SCENARIOS[CAPACITY_SCENARIOS["long-prompts"]], long_prompt_every_s=None)
    return {**simulate_rate(config, spec, rate, setup), "configuration": config.label}


def main(args: argparse.Namespace) -> int:
    from gpu.catalog import CatalogError
    from ops.sim.capacity import CAPACITY_SCENARIOS as SUITE
    from ops.sim.capacity import (
        CONFIGURATIONS,
        DEFAULT_CONFIGURATIONS,
        SearchSettings,
        Setup,
        SloTargets,
        is_baseline,
        parse_variant,
        speculation_configurations,
    )
    from ops.sim.capacity_report import capacity_table, write_report
    from ops.sim.catalogs import build_catalogs
    from ops.sim.costs import CostTableError
    from ops.sim.engine import SimOptions
    from ops.sim.long_prompt_check import long_prompt_rows, long_prompt_table, pure_prefill_ms
    from ops.sim.workloads import SCENARIOS
    from ops.sim_command import cost_table, max_running
    from policy.baselines.fixed_spec import fixed_spec_depth

    def fail(message: str) -> int:
        print(f"flare sim-capacity: {message}", file=sys.stderr)
        return 2

    if not (args.ttft > 0 and args.tpot > 0 and 0 < args.attainment <= 1):
        return fail("--ttft and --tpot must be positive and --attainment in (0, 1]")
    if not (0 < args.rate_min <= args.start_rate <= args.rate_max) or args.bisections < 0:
        return fail("want 0 < --rate-min <= --start-rate <= --rate-max, --bisections >= 0")
    if args.count < 1 or args.jobs < 1:
        return fail("--num-requests and --jobs must be positive")
    if not (0 <= args.acceptance <= 1 and 0 <= args.acceptance_spread <= 1):
        return fail("--acceptance and --acceptance-spread must be in [0, 1]")
    chosen = args.configurations or [c.label for c in DEFAULT_CONFIGURATIONS]
    configs = [c for c in CONFIGURATIONS if c.label in chosen]
    if args.with_speculation:
        configs += [c for c in speculation_configurations(args.draft_depth)
                    if c not in configs]
    try:
        configs += [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        return fail(str(exc))
    speculating = any(c.speculates for c in configs)
    if speculating and args.draft_depth < 1:
        return fail("speculating configurations need --draft-depth >= 1")
    too_deep = [c.label for c in configs if (fixed_spec_depth(c.policy) or 0) > args.draft_depth]
    if too_deep:
        return fail(f"{', '.join(too_deep)} need(s) a deeper load than --draft-depth "
                    f"{args.draft_depth}")
    scenarios = list(args.scenarios or SUITE)
    try:
        catalogs = build_catalogs(max_batch=args.max_batch,
                                  prefill_capacities=args.prefill_capacities,
                                  mixed_prefill=True,
                                  draft_depth=args.draft_depth if speculating else 0,
                                  speculative_mixed=args.speculative_mixed,
                                  state_operations=args.state_operations)
        costs = cost_table(args, catalogs.union(c.policy for c in configs))
        running = max_running(args)
    except (CatalogError, CostTableError, ValueError, OSError) as exc:
        return fail(str(exc))
    count = QUICK_COUNT if args.quick else args.count
    steps = 1 if args.quick else args.bisections
    setup = Setup(catalogs=catalogs, costs=costs, count=count,
                  options=SimOptions(max_resident=running, seed=args.seed,
                                     dispatch_ns=round(args.dispatch_us * 1000),
                                     draft_counterfactuals=speculating,
                                     admission=args.admission_order),
                  targets=SloTargets(ttft_s=args.ttft, tpot_s=args.tpot,
                                     attainment=args.attainment),
                  acceptance=(args.acceptance, args.acceptance_spread)
                  if speculating else None)
    settings = SearchSettings(start=args.start_rate, rate_min=args.rate_min,
                              rate_max=args.rate_max, steps=steps)
    tasks = [(c, s, setup, settings) for s in scenarios for c in configs]
    with ProcessPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else _Inline() as pool:
        results = list(pool.map(_capacity_task, tasks))
        pareto_rates = {}
        for s in scenarios:
            baseline = [r["capacity_rps"] for r in results
                        if r["scenario"] == s and is_baseline(r["configuration"])]
            pareto_rates[s] = args.pareto_rate or max(baseline, default=0.0) \
                or args.start_rate
        pareto = list(pool.map(_rate_task, [(c, s, pareto_rates[s], setup)
                                            for s in scenarios for c in configs]))
        checked, alone = [], []
        if "long-prompts" in scenarios:
            checked = list(pool.map(_rate_task, [(c, "long-prompts", args.long_prompt_rate,
                                                  setup) for c in configs]))
            alone = list(pool.map(_chat_alone_task, [(c, args.long_prompt_rate, setup)
                                                     for c in configs]))
    report_settings = {
        "cost_source": costs.source, "synthetic": costs.synthetic,
        "ttft_s": args.ttft, "tpot_s": args.tpot, "attainment": args.attainment,
        "requests_per_run": count, "max_running": running, "admission": args.admission_order,
        "max_batch": args.max_batch,
        "prefill_capacities": list(args.prefill_capacities), "seed": args.seed,
        "state_operations": args.state_operations,
        "speculation": {"draft_depth": args.draft_depth, "acceptance": args.acceptance,
                        "acceptance_spread": args.acceptance_spread,
                        "speculative_mixed": args.speculative_mixed}
        if speculating else None,
        "search": {"start": settings.start, "rate_min": settings.rate_min,
                   "rate_max": settings.rate_max, "bisections": settings.steps},
        "pareto_rates": pareto_rates,
    }
    labels = [c.label for c in configs]
    long_check = ""
    if checked:
        spec = SCENARIOS[SUITE["long-prompts"]]
        prefill_ms = pure_prefill_ms(spec.long_prompt_tokens, catalogs.ordinary, costs)
        rows = long_prompt_rows(checked, prefill_ms,
                                alone={r["configuration"]: r for r in alone})
        long_check = long_prompt_table(rows, prefill_ms)
        report_settings["long_prompt_check"] = {"rate": args.long_prompt_rate,
                                                "pure_prefill_ms": prefill_ms, "rows": rows}
    write_report(args.output_dir, settings=report_settings, results=results,
                 pareto=pareto, scenarios=scenarios, configurations=labels,
                 plot=not args.no_plots, appendix=long_check)
    kind = "synthetic" if costs.synthetic else "measured"
    print(f"flare sim-capacity: {costs.source} ({kind}), TTFT <= {args.ttft:g} s, "
          f"TPOT <= {args.tpot:g} s for {args.attainment:.0%} of each client's requests, "
          f"{count} requests per run, at most {running} running, "
          f"{args.admission_order} admission")
    print(capacity_table(results, scenarios, labels), end="")
    if long_check:
        print(long_check, end="")
    cpu = sum(r["simulation_cpu_s"] for r in results)
    print(f"simulation CPU {cpu:.1f} s; wrote {args.output_dir}")
    return 0


class _Inline:
    """``map`` in this process (``--jobs 1``), with the pool's context-manager face."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn: Any, items: Any) -> Any:
        return map(fn, items)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="flare sim-capacity",
                                      description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
