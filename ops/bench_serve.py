"""``flare bench serve``: load-benchmark any OpenAI-compatible streaming endpoint.

Plans a workload (``ops.loadgen.workload``), sends it open-loop (or with fixed concurrency),
writes ``<output-dir>/<label>.json`` with every metric and per-request record, and draws
``latency-cdf.png`` and ``tokens-over-time.png`` overlaying this run with any ``--compare``
run files (so several scheduler policies can be put side by side). ``--no-run`` only
re-plots existing run files. See ``docs/load-benchmark.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from functools import partial

import trio

from ops.loadgen.client import Progress, Target, run_load
from ops.loadgen.metrics import MetricOptions, summarize
from ops.loadgen.prompts import load_prompt_builder
from ops.loadgen.report import (
    RunFile,
    plot_latency_cdfs,
    plot_tokens_over_time,
    read_run,
    summary_table,
    write_run,
)
from ops.loadgen.workload import LengthSpec, parse_clients, plan_requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, without /v1 (default %(default)s)",
    )
    target.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default %(default)s)",
    )
    target.add_argument(
        "--model",
        default=None,
        help="model name sent in each request (default: first of /v1/models)",
    )
    target.add_argument("--api-key", default=None, help="sent as a Bearer token if given")
    target.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos=true so outputs reach their target length",
    )
    target.add_argument("--temperature", type=float, default=None)
    target.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON object merged into every request body",
    )
    target.add_argument(
        "--request-timeout", type=float, default=600.0, help="per-request HTTP timeout in seconds"
    )

    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=200)
    load.add_argument(
        "--rate",
        type=float,
        default=4.0,
        help="mean requests per second over all clients; inf = all at once",
    )
    load.add_argument("--arrivals", choices=("poisson", "gamma"), default="poisson")
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape: <1 bursty, 1 Poisson-like, >1 smooth",
    )
    load.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop with this many workers instead of timed arrivals",
    )
    load.add_argument(
        "--time-limit",
        type=float,
        default=600.0,
        help="stop sending and cancel what is in flight after this many seconds",
    )
    load.add_argument(
        "--clients", default="default", help="client tags and demand weights, e.g. 'alice:3,bob:1'"
    )
    load.add_argument("--seed", type=int, default=0)

    lengths = parser.add_argument_group("lengths (tokens)")
    lengths.add_argument(
        "--lengths",
        choices=("fixed", "uniform", "sharegpt"),
        default="fixed",
        help="fixed, uniform in [min,max], or the synthetic ShareGPT-like mix",
    )
    lengths.add_argument("--prompt-tokens", type=int, default=128)
    lengths.add_argument("--output-tokens", type=int, default=128)
    lengths.add_argument("--prompt-min", type=int, default=4)
    lengths.add_argument("--prompt-max", type=int, default=1024)
    lengths.add_argument("--output-min", type=int, default=1)
    lengths.add_argument("--output-max", type=int, default=512)
    lengths.add_argument(
        "--model-dir",
        type=pathlib.Path,
        default=None,
        help="directory with tokenizer.json (default models/default)",
    )

    metrics = parser.add_argument_group("metrics")
    metrics.add_argument("--ttft-slo", type=float, default=None, help="goodput TTFT SLO (s)")
    metrics.add_argument("--tpot-slo", type=float, default=None, help="goodput TPOT SLO (s)")
    metrics.add_argument(
        "--qoe-ttft",
        type=float,
        default=1.0,
        help="QoE: when the reader expects the first token (s)",
    )
    metrics.add_argument(
        "--qoe-reading-speed",
        type=float,
        default=10.0,
        help="QoE: reader's speed in tokens per second",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        help="seconds between progress lines on stderr; 0 = quiet",
    )
    output.add_argument("--label", default="run", help="run name in files, legends and tables")
    output.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("bench-results"))
    output.add_argument(
        "--compare",
        type=pathlib.Path,
        nargs="*",
        default=[],
        help="earlier run files to overlay on the plots and table",
    )
    output.add_argument(
        "--no-run",
        action="store_true",
        help="send nothing; only plot and tabulate the --compare files",
    )


def _print_progress(p: Progress) -> None:
    print(
        f"[{p.elapsed_s:7.1f} s] sent {p.sent}/{p.planned}, finished {p.finished}, "
        f"in flight {p.sent - p.finished}, errors {p.errors}, chunks {p.output_chunks}",
        file=sys.stderr,
    )


def _execute(args: argparse.Namespace) -> RunFile:
    builder, warning = load_prompt_builder(args.model_dir)
    if warning:
        print(f"flare bench serve: {warning}", file=sys.stderr)
    lengths = LengthSpec(
        kind=args.lengths,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        prompt_min=args.prompt_min,
        prompt_max=args.prompt_max,
        output_min=args.output_min,
        output_max=args.output_max,
    )
    plans = plan_requests(
        count=args.num_requests,
        rate=math.inf if args.concurrency else args.rate,
        arrivals=args.arrivals,
        lengths=lengths,
        clients=parse_clients(args.clients),
        seed=args.seed,
        burstiness=args.burstiness,
    )
    target = Target(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
    )
    result = trio.run(
        partial(
            run_load,
            target,
            plans,
            builder,
            time_limit_s=args.time_limit,
            concurrency=args.concurrency,
            seed=args.seed,
            on_progress=_print_progress if args.progress_every > 0 else None,
            progress_interval_s=args.progress_every if args.progress_every > 0 else 10.0,
        )
    )
    options = MetricOptions(
        ttft_slo_s=args.ttft_slo,
        tpot_slo_s=args.tpot_slo,
        qoe_expected_ttft_s=args.qoe_ttft,
        qoe_reading_tokens_per_s=args.qoe_reading_speed,
    )
    summary = summarize(
        result.records, duration_s=result.duration_s, planned=result.planned, options=options
    )
    summary["hit_time_limit"] = result.hit_time_limit
    config = {
        k: (str(v) if isinstance(v, pathlib.Path) else v)
        for k, v in vars(args).items()
        if not k.startswith("_") and k not in ("compare", "no_run", "api_key")
    }
    config["prompt_builder"] = builder.description
    config["model"] = result.model
    return RunFile(label=args.label, config=config, summary=summary, records=result.records)


def main(args: argparse.Namespace) -> int:
    runs: list[RunFile] = []
    try:
        compared = [read_run(p) for p in args.compare]
        if not args.no_run:
            run = _execute(args)
            path = args.output_dir / f"{args.label}.json"
            write_run(path, run)
            print(f"wrote {path}")
            runs.append(run)
    except (ValueError, OSError) as exc:  # bad options or unreadable run files
        print(f"flare bench serve: {exc}", file=sys.stderr)
        return 2
    runs.extend(compared)
    if not runs:
        print("flare bench serve: nothing to report (--no-run without --compare)", file=sys.stderr)
        return 2
    plot_latency_cdfs(runs, args.output_dir / "latency-cdf.png")
    plot_tokens_over_time(runs, args.output_dir / "tokens-over-time.png")
    print(summary_table(runs))
    if not args.no_run and runs[0].summary["requests"]["ok"] == 0:
        print("flare bench serve: no request succeeded", file=sys.stderr)
        return 1
    return 0
