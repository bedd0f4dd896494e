"""``flare sim``: simulate scheduling policies on a cost table, no model or device needed.

Drives the real policy code (the seed's scheduler presets ``balanced``/``throughput``,
its speculative scheduler ``spec-adaptive``/``spec-fixed``, and the baselines
``fcfs``/``sarathi``/``vtc``/``fixed-spec-K``) through ``ops.sim`` on a synthetic or
measured (``flare bench programs --json``) cost table, over a named scenario or a
workload built from flags, and writes per-policy run files, ``sim.json`` and PNG plots
(see ``docs/simulator.md``). Deterministic for a given ``--seed``. Prints the summary
table and how long each policy took to simulate.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Any

from ops.loadgen.metrics import MetricOptions
from ops.loadgen.workload import LengthSpec, parse_clients
from policy.baselines.factory import COMPARED_POLICIES
from policy.vision_windows import DEFAULT_WINDOW_IMAGES

DEFAULT_POLICIES = COMPARED_POLICIES
SPECULATIVE_POLICIES = ("balanced", "spec-adaptive", "spec-fixed", "fixed-spec-1",
                        "fixed-spec-2", "fixed-spec-4", "sarathi")
"""The default comparison of the ``acceptance`` scenario."""


def default_policies(scenario_name: str) -> tuple[str, ...]:
    return SPECULATIVE_POLICIES if scenario_name == "acceptance" else DEFAULT_POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ops.sim.catalogs import (
        DEFAULT_DRAFT_DEPTH,
        NO_SPECULATIVE_MIXED_HELP,
        STATE_OPERATIONS_HELP,
    )
    from ops.sim.workloads import SCENARIOS
    from policy.baselines import DEFAULT_TOKEN_BUDGET, POLICY_NAMES

    pol = parser.add_argument_group("policies")
    pol.add_argument("--policy", nargs="+", choices=POLICY_NAMES, default=None,
                     dest="policies",
                     help=f"policies to simulate (default: {' '.join(DEFAULT_POLICIES)}; "
                          f"for --scenario acceptance: {' '.join(SPECULATIVE_POLICIES)})")
    pol.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET,
                     help="sarathi/vtc/fixed-spec-K tokens per step")

    work = parser.add_argument_group("workload (a scenario, with any field overridden)")
    work.add_argument("--scenario", choices=tuple(SCENARIOS), default="poisson")
    work.add_argument("--num-requests", type=int, default=None, dest="count")
    work.add_argument("--rate", type=float, default=None, help="requests per second")
    work.add_argument("--arrivals", choices=("poisson", "gamma"), default=None)
    work.add_argument("--burstiness", type=float, default=None,
                      help="gamma shape: <1 bursty, 1 Poisson-like")
    work.add_argument("--clients", default=None, help="tags and demand weights, e.g. 'a:3,b:1'")
    work.add_argument("--lengths", choices=("fixed", "uniform", "sharegpt"), default=None)
    work.add_argument("--prompt-tokens", type=int, default=128)
    work.add_argument("--output-tokens", type=int, default=128)
    work.add_argument("--prompt-min", type=int, default=4)
    work.add_argument("--prompt-max", type=int, default=1024)
    work.add_argument("--output-min", type=int, default=1)
    work.add_argument("--output-max", type=int, default=512)
    work.add_argument("--long-prompt-every", type=float, default=None,
                      dest="long_prompt_every_s", help="seconds between long prompts")
    work.add_argument("--long-prompt-tokens", type=int, default=None)
    work.add_argument("--long-output-tokens", type=int, default=None)
    work.add_argument("--acceptance", type=float, default=None,
                      help="per-draft acceptance rate of every request (default 0.6)")
    work.add_argument("--client-acceptance", default=None,
                      help="per-client acceptance rates, e.g. 'code:0.9,chat:0.3'")
    work.add_argument("--acceptance-spread", type=float, default=None,
                      help="spread each request's acceptance uniformly by +-this much")
    work.add_argument("--images-per-request", type=int, default=0,
                      help="images in every prompt (evenly spaced; as many as fit), served as "
                           "flare serves image prompts (docs/vision.md)")
    work.add_argument("--tokens-per-image", type=int, default=576,
                      help="placeholder positions of one image (default 576, LLaVA-1.5)")
    work.add_argument("--seed", type=int, default=0)

    dev = parser.add_argument_group("simulated server")
    add_cost_arguments(dev)
    dev.add_argument("--noise", type=float, default=0.0,
                     help="log-normal sigma of multiplicative duration noise")
    dev.add_argument("--max-batch", type=int, default=16)
    dev.add_argument("--prefill-capacity", type=int, nargs="+", default=[64, 256, 1024],
                     dest="prefill_capacities")
    dev.add_argument("--no-mixed-prefill", action="store_false", dest="mixed_prefill",
                     help="prepare no mixed prefill/decode programs")
    dev.add_argument("--draft-depth", type=int, default=DEFAULT_DRAFT_DEPTH,
                     help="proposal depth D of the speculative load the speculative policies "
                          "run on (widths 1..D+1, as flare run --draft-depth)")
    dev.add_argument("--no-speculative-mixed", action="store_false", dest="speculative_mixed",
                     help=NO_SPECULATIVE_MIXED_HELP)
    dev.add_argument("--state-operations", action="store_true",
                     help=STATE_OPERATIONS_HELP)
    dev.add_argument("--max-running", "--max-resident", type=int, default=None,
                     dest="max_running",
                     help="requests resident and running at once, the same limit for every "
                          "policy (default: --max-batch)")
    add_admission_argument(dev)
    dev.add_argument("--max-queue", type=int, default=None,
                     help="refuse arrivals when this many wait (default: unbounded)")
    dev.add_argument("--dispatch-us", type=float, default=50.0,
                     help="host gap before a frame committed into an empty window starts")
    dev.add_argument("--max-tokens", type=int, default=2048,
                     help="max_tokens requests are admitted with (0: exactly their length)")
    dev.add_argument("--cold-estimates", action="store_true",
                     help="start with no duration estimates (the seed discovers shapes)")
    dev.add_argument("--horizon", type=float, default=None, help="stop at this simulated time (s)")
    dev.add_argument("--vision-feature-images", type=int, default=DEFAULT_WINDOW_IMAGES,
                     help="feature storage in images: the images of one prefill window "
                          f"(default {DEFAULT_WINDOW_IMAGES}, as flare run)")
    dev.add_argument("--vision-ms-per-image", type=float, default=4.0,
                     help="synthetic duration of encoding one image (ms)")
    dev.add_argument("--vision-ms-per-execution", type=float, default=0.0,
                     help="synthetic fixed cost of one vision program execution (ms)")
    dev.add_argument("--vision", choices=("scheduled", "fused"), default="scheduled",
                     help="scheduled (default, as flare run on the CPU backend): vision "
                          "programs in the catalog, run as prerequisite frames; fused: "
                          "prompt frames encode their window's images (docs/vision.md)")

    met = parser.add_argument_group("metrics and output")
    met.add_argument("--ttft-slo", type=float, default=None)
    met.add_argument("--tpot-slo", type=float, default=None)
    met.add_argument("--qoe-ttft", type=float, default=1.0)
    met.add_argument("--qoe-reading-speed", type=float, default=10.0)
    met.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("sim-results"))
    met.add_argument("--no-plots", action="store_true")


def add_cost_arguments(group: argparse._ArgumentGroup) -> None:
    """``--costs`` and ``--cost-model`` (shared with ``flare sim capacity``)."""
    from ops.sim.roofline import COST_MODELS

    group.add_argument("--costs", type=pathlib.Path, default=None,
                       help="flare bench programs --json file (replaces --cost-model)")
    group.add_argument("--cost-model", choices=COST_MODELS, default=None,
                       help="named cost model (default: linear, the synthetic a + b * size "
                            "model; roofline-*: docs/simulator.md, Roofline)")


def add_admission_argument(group: argparse._ArgumentGroup) -> None:
    """``--admission-order`` (shared with ``flare sim-capacity``)."""
    from policy.admission_order import ADMISSION_ORDERS

    group.add_argument("--admission-order", choices=ADMISSION_ORDERS, default="fifo",
                       help="which waiting request becomes resident next (default fifo; "
                            "least-slack: by arrival minus the prompt's pure prefill time, "
                            "as flare run --admission-order least-slack)")


def cost_table(args: argparse.Namespace, catalog: Any) -> Any:
    """The cost table ``--costs`` or ``--cost-model`` names (``CostTableError``)."""
    from ops.sim.costs import CostTableError, load_bench_programs
    from ops.sim.roofline import named_cost_table

    if args.costs is not None:
        if args.cost_model is not None:
            raise CostTableError("pass --costs or --cost-model, not both")
        return load_bench_programs(args.costs, catalog)
    return named_cost_table(args.cost_model or "linear", catalog)


def max_running(args: argparse.Namespace) -> int:
    """``--max-running``, defaulting to the largest decode batch (``ValueError``)."""
    limit = args.max_batch if args.max_running is None else args.max_running
    if limit < 1:
        raise ValueError("--max-running must be positive")
    return int(limit)


def _workload(args: argparse.Namespace) -> Any:
    from ops.sim.workloads import parse_client_acceptance, scenario

    lengths = None
    if args.lengths is not None:
        lengths = LengthSpec(kind=args.lengths, prompt_tokens=args.prompt_tokens,
                             output_tokens=args.output_tokens, prompt_min=args.prompt_min,
                             prompt_max=args.prompt_max, output_min=args.output_min,
                             output_max=args.output_max)
    return scenario(
        args.scenario, count=args.count, rate=args.rate, arrivals=args.arrivals,
        burstiness=args.burstiness, lengths=lengths,
        clients=parse_clients(args.clients) if args.clients else None,
        long_prompt_every_s=args.long_prompt_every_s,
        long_prompt_tokens=args.long_prompt_tokens,
        long_output_tokens=args.long_output_tokens, acceptance=args.acceptance,
        client_acceptance=parse_client_acceptance(args.client_acceptance)
        if args.client_acceptance else None,
        acceptance_spread=args.acceptance_spread, seed=args.seed,
    )


def main(args: argparse.Namespace) -> int:
    from gpu.catalog import CatalogError
    from ops.sim.catalogs import build_catalogs
    from ops.sim.costs import CostTableError
    from ops.sim.engine import SimOptions, SimulationError
    from ops.sim.runs import run_policies, write_outputs
    from ops.sim.vision import VisionLoad
    from ops.sim.workloads import build_workload
    from policy.types import PolicyError

    def fail(message: str) -> int:
        print(f"flare sim: {message}", file=sys.stderr)
        return 2

    policies = tuple(args.policies or default_policies(args.scenario))
    try:
        catalogs = build_catalogs(
            max_batch=args.max_batch, prefill_capacities=args.prefill_capacities,
            mixed_prefill=args.mixed_prefill, draft_depth=args.draft_depth,
            speculative_mixed=args.speculative_mixed,
            state_operations=args.state_operations)
        catalog = catalogs.union(policies)
        costs = cost_table(args, catalog)
        spec = _workload(args)
        requests = build_workload(spec)
        running = max_running(args)
        vision = VisionLoad(images_per_request=args.images_per_request,
                            tokens_per_image=args.tokens_per_image,
                            window_images=args.vision_feature_images,
                            ms_per_image=args.vision_ms_per_image,
                            ms_per_execution=args.vision_ms_per_execution,
                            scheduled=args.vision == "scheduled")
    except (CatalogError, CostTableError, ValueError, OSError) as exc:
        return fail(str(exc))
    if not math.isfinite(args.noise) or args.noise < 0:
        return fail("--noise must be a finite non-negative number")
    options = SimOptions(max_resident=running, max_queue=args.max_queue,
                         dispatch_ns=round(args.dispatch_us * 1000),
                         output_limit=args.max_tokens, noise=args.noise,
                         warm_estimates=not args.cold_estimates, seed=args.seed,
                         horizon_s=args.horizon, vision=vision,
                         admission=args.admission_order)
    metrics = MetricOptions(ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo,
                            qoe_expected_ttft_s=args.qoe_ttft,
                            qoe_reading_tokens_per_s=args.qoe_reading_speed)
    config = {"scenario": args.scenario, "max_batch": args.max_batch,
              "prefill_capacities": list(args.prefill_capacities),
              "mixed_prefill": args.mixed_prefill, "token_budget": args.token_budget,
              "draft_depth": args.draft_depth, "speculative_mixed": args.speculative_mixed,
              "state_operations": args.state_operations,
              "max_running": running, "admission": args.admission_order,
              "cost_source": costs.source}
    try:
        runs = run_policies(policies, requests=requests, catalogs=catalogs, costs=costs,
                            options=options, metrics=metrics, token_budget=args.token_budget,
                            config=config,
                            progress=lambda line: print(line, file=sys.stderr))
    except (PolicyError, SimulationError) as exc:
        return fail(str(exc))
    write_outputs(args.output_dir, runs, workload=spec, options=options, costs=costs,
                  config=config, plots=not args.no_plots)
    label = (f"synthetic costs ({costs.source})" if costs.synthetic
             else f"costs from {costs.source}")
    print(f"flare sim: scenario {args.scenario}, {len(requests)} requests, {label}")
    from ops.loadgen.report import summary_table
    print(summary_table([r.run for r in runs]))
    print("time per policy:")
    for r in runs:
        print(f"  {r.timing_line()}")
    print(f"wrote {args.output_dir}")
    return 0


if __name__ == "__main__":  # ``python -m ops.sim_command`` until ``flare sim`` is wired
    _parser = argparse.ArgumentParser(prog="flare sim", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
