"""Side-by-side policy comparison on the real server (``flare bench compare``).

For each scheduling policy this driver starts ``flare run --scheduler-policy NAME`` as a
subprocess on a free loopback port, waits for ``/health``, sends one fixed workload with
the load benchmark's open-loop client (``ops.loadgen.client.run_load``, what ``flare
bench serve`` runs), stops the server with SIGTERM and writes the run file
(``<policy>.json``, readable by ``flare bench serve --compare``). The workload is built
by ``ops.sim.workloads.build_workload`` from a named scenario, so the same traffic
description drives ``flare sim`` and the real server (the long-prompt interference
scenario needs that: ``flare bench serve`` alone has no periodic long prompts). Every
run is bounded in request count and time (``--time-limit``). ``--concurrency N`` sends the
same requests from N closed-loop streams instead (each sends its next request when the
last one ends, as an external benchmark client's fixed-concurrency mode does), and
``--prompt-tokens``/``--output-tokens`` fix every request's lengths.

``--tabulate DIR`` prints the Markdown comparison table of the run files already in
``DIR`` (``flare sim`` output directories too, including the speculative policies and
the ``acceptance`` scenario's per-client view), without starting anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ops import launch
from policy.baselines.factory import COMPARED_POLICIES, RUNTIME_POLICIES

POLICIES = COMPARED_POLICIES

# Real-server scenario sizes for the CPU backend and the embedded default model (context
# 2048): small, so one policy's run takes about a minute on a shared 2-core machine.
REAL_SCENARIOS: dict[str, dict[str, Any]] = {
    "interference": dict(count=24, rate=0.5, long_prompt_every_s=8.0, long_prompt_tokens=1536,
                         long_output_tokens=8),
    "fairness": dict(count=32, rate=2.0),
    "bursty": dict(count=24, rate=0.6),
    "poisson": dict(count=24, rate=0.6),
}
REPO_ROOT = launch.REPO_ROOT
CHAT_PROMPT_MAX = 256
CHAT_OUTPUT_MAX = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=tuple(REAL_SCENARIOS), default="interference")
    parser.add_argument("--policy", nargs="+", choices=RUNTIME_POLICIES, default=list(POLICIES))
    parser.add_argument("--num-requests", type=int, default=None, help="chat requests")
    parser.add_argument("--rate", type=float, default=None, help="chat requests per second")
    parser.add_argument("--long-prompt-every", type=float, default=None, metavar="S",
                        help="interference: one long prompt every S seconds (default 8)")
    parser.add_argument("--prompt-max", type=int, default=CHAT_PROMPT_MAX)
    parser.add_argument("--output-max", type=int, default=CHAT_OUTPUT_MAX)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="every prompt this long (with --output-tokens: fixed lengths)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help="every answer this long (with --prompt-tokens)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed-loop streams instead of the scenario's arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=240.0,
                        help="seconds one policy's load may run")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--server-args", default="--mixed-prefill --log-level warning",
                        help="extra flare run flags (one string)")
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("compare-results"))
    parser.add_argument("--tabulate", type=pathlib.Path, nargs="+", default=None,
                        help="only print the table of the run files in these directories "
                             "(several: one sweep table, a row per directory and policy)")


def scheduler_metrics(base_url: str) -> dict[str, float]:
    """The server's ``flare_scheduler_*`` Prometheus samples (execution time and count by
    kind, executions per graph), read just before it is stopped; empty if unreadable."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        if line.startswith("flare_scheduler_"):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                continue
    return samples


def start_server(policy: str, port: int, extra: Sequence[str], log: pathlib.Path,
                 timeout_s: float) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ops.cli", "run", "--scheduler-policy", policy,
           "--host", "127.0.0.1", "--port", str(port), *extra]
    return launch.start(cmd, port=port, log=log, timeout_s=timeout_s)


def _workload(args: argparse.Namespace) -> Any:
    from ops.loadgen.workload import LengthSpec
    from ops.sim.workloads import scenario

    preset = dict(REAL_SCENARIOS[args.scenario])
    if args.num_requests is not None:
        preset["count"] = args.num_requests
    if args.rate is not None:
        preset["rate"] = args.rate
    if args.long_prompt_every is not None:
        if "long_prompt_every_s" not in preset:
            raise ValueError("--long-prompt-every needs --scenario interference")
        if not args.long_prompt_every > 0:
            raise ValueError("--long-prompt-every must be positive")
        preset["long_prompt_every_s"] = args.long_prompt_every
    if (args.prompt_tokens is None) != (args.output_tokens is None):
        raise ValueError("--prompt-tokens and --output-tokens go together")
    if args.prompt_tokens is not None:
        lengths = LengthSpec(kind="fixed", prompt_tokens=args.prompt_tokens,
                             output_tokens=args.output_tokens)
    else:
        lengths = LengthSpec(kind="sharegpt", prompt_max=args.prompt_max,
                             output_max=args.output_max)
    # The named scenario keeps its arrivals and clients (fairness: heavy:3, light:1).
    return scenario(args.scenario, lengths=lengths, seed=args.seed, **preset)


def run_policy(policy: str, args: argparse.Namespace, spec: Any, plans: Sequence[Any]) -> Any:
    import trio

    from ops.loadgen.client import Target, run_load
    from ops.loadgen.metrics import MetricOptions, summarize
    from ops.loadgen.prompts import load_prompt_builder
    from ops.loadgen.report import RunFile
    from ops.sim.runs import per_client_latency

    port = launch.free_port()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    log = args.output_dir / f"{policy}.server.log"
    started = time.monotonic()
    proc = start_server(policy, port, args.server_args.split(), log, args.startup_timeout)
    startup_s = time.monotonic() - started
    try:
        builder, _ = load_prompt_builder(REPO_ROOT / "models" / "default")
        target = Target(base_url=f"http://127.0.0.1:{port}", endpoint="completions", model=None,
                        request_timeout_s=args.time_limit, ignore_eos=True)
        result = trio.run(partial(run_load, target, plans, builder,
                                  time_limit_s=args.time_limit, seed=args.seed,
                                  concurrency=args.concurrency))
        metrics = scheduler_metrics(f"http://127.0.0.1:{port}")
    finally:
        launch.stop(proc)
    summary = summarize(result.records, duration_s=result.duration_s, planned=result.planned,
                        options=MetricOptions())
    summary["hit_time_limit"] = result.hit_time_limit
    summary["per_client"] = per_client_latency(result.records)
    summary["server_scheduler_metrics"] = metrics
    config = {"scenario": args.scenario, "policy": policy, "workload": spec.to_json(),
              "server_args": args.server_args, "startup_s": startup_s,
              "load_average": os.getloadavg(), "time_limit_s": args.time_limit,
              "concurrency": args.concurrency}
    return RunFile(label=policy, config=config, summary=summary, records=result.records)


def _ms(d: dict[str, Any] | None, key: str) -> str:
    value = None if d is None else d.get(key)
    if value is None or math.isnan(value):
        return "-"
    return f"{value * 1000:.1f}" if value < 0.1 else f"{value * 1000:.0f}"


def _s(d: dict[str, Any] | None, key: str) -> str:
    value = None if d is None else d.get(key)
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


Row = Callable[[dict[str, Any]], list[str]]


def _clients(s: dict[str, Any]) -> dict[str, Any]:
    return dict(s.get("per_client", {}))


def _interference(s: dict[str, Any]) -> list[str]:
    c = _clients(s)
    chat: dict[str, Any] = next((v for k, v in c.items() if k != "long"), {})
    long: dict[str, Any] = c.get("long", {})
    return [f"{_ms(chat.get('ttft_s'), 'median')} / {_ms(chat.get('ttft_s'), 'p99')}",
            _ms(chat.get("tpot_s"), "median"),
            f"{_ms(chat.get('itl_s'), 'p99')} / {_ms(chat.get('itl_s'), 'max')}",
            _ms(long.get("ttft_s"), "median"), _s(long.get("e2e_s"), "median"),
            f"{s['throughput']['output_tokens_per_s']:.0f}"]


def _fairness(s: dict[str, Any]) -> list[str]:
    c = _clients(s)
    heavy, light = c.get("heavy", {}), c.get("light", {})
    return [f"{_ms(heavy.get('ttft_s'), 'median')} / {_ms(heavy.get('ttft_s'), 'p99')}",
            f"{_ms(light.get('ttft_s'), 'median')} / {_ms(light.get('ttft_s'), 'p99')}",
            _s(heavy.get("e2e_s"), "median"), _s(light.get("e2e_s"), "median"),
            _ms(s["tpot_s"], "median"),
            f"{s['fairness']['jain_service_per_demand']:.3f}", f"{s['duration_s']:.1f}"]


def _acceptance(s: dict[str, Any]) -> list[str]:
    c = _clients(s)
    code, chat = c.get("code", {}), c.get("chat", {})
    spec = s.get("simulator", {}).get("speculation", {})
    rate = spec.get("acceptance_rate")
    return [f"{_ms(s['ttft_s'], 'median')} / {_ms(s['ttft_s'], 'p99')}",
            f"{_ms(code.get('tpot_s'), 'median')} / {_ms(chat.get('tpot_s'), 'median')}",
            f"{_s(code.get('e2e_s'), 'median')} / {_s(chat.get('e2e_s'), 'median')}",
            f"{_s(s['e2e_s'], 'p99')}", f"{_ms(s['itl_s'], 'p99')}",
            "-" if rate is None else f"{rate:.2f}",
            f"{s['throughput']['output_tokens_per_s']:.0f}"]


def _plain(s: dict[str, Any]) -> list[str]:
    return [f"{_ms(s['ttft_s'], 'median')} / {_ms(s['ttft_s'], 'p99')}",
            f"{_ms(s['tpot_s'], 'median')} / {_ms(s['tpot_s'], 'p99')}",
            f"{_ms(s['itl_s'], 'p99')} / {_ms(s['itl_s'], 'max')}",
            f"{_s(s['e2e_s'], 'median')} / {_s(s['e2e_s'], 'p99')}",
            f"{s['throughput']['output_tokens_per_s']:.0f}",
            f"{s['requests']['ok']}/{s['requests']['sent']}"]


TABLES: dict[str, tuple[list[str], Row]] = {
    "interference": (["chat TTFT p50 / p99 (ms)", "chat TPOT p50 (ms)",
                      "chat ITL p99 / max (ms)", "long TTFT p50 (ms)", "long E2E p50 (s)",
                      "output tok/s"], _interference),
    "fairness": (["heavy TTFT p50 / p99 (ms)", "light TTFT p50 / p99 (ms)",
                  "heavy E2E p50 (s)", "light E2E p50 (s)", "TPOT p50 (ms)",
                  "Jain per demand", "duration (s)"], _fairness),
    "plain": (["TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "ITL p99 / max (ms)",
               "E2E p50 / p99 (s)", "output tok/s", "ok/sent"], _plain),
    "acceptance": (["TTFT p50 / p99 (ms)", "TPOT p50 code / chat (ms)",
                    "E2E p50 code / chat (s)", "E2E p99 (s)", "ITL p99 (ms)",
                    "drafts accepted", "output tok/s"], _acceptance),
}


def markdown_table(kind: str, summaries: Sequence[tuple[str, dict[str, Any]]]) -> str:
    headers, row = TABLES[kind]
    lines = ["| policy | " + " | ".join(headers) + " |",
             "|---" * (len(headers) + 1) + "|"]
    for label, summary in summaries:
        lines.append(f"| {label} | " + " | ".join(row(summary)) + " |")
    return "\n".join(lines)


def _kind_of(clients: set[str]) -> str:
    if "long" in clients:
        return "interference"
    if {"heavy", "light"} <= clients:
        return "fairness"
    if {"code", "chat"} <= clients:
        return "acceptance"
    return "plain"


def tabulate(directory: pathlib.Path) -> str:
    from ops.loadgen.report import read_run
    from ops.sim.runs import per_client_latency
    from policy.baselines import POLICY_NAMES

    summaries = []
    for name in POLICY_NAMES:
        path = directory / f"{name}.json"
        if path.exists():
            run = read_run(path)
            summary = dict(run.summary)
            summary["per_client"] = per_client_latency(run.records)
            summaries.append((name, summary))
    if not summaries:
        raise ValueError(f"{directory}: no <policy>.json run files")
    clients = set(summaries[0][1]["per_client"])
    return markdown_table(_kind_of(clients), summaries)


def _sweep_row(s: dict[str, Any]) -> list[str]:
    return [f"{_ms(s['ttft_s'], 'median')} / {_ms(s['ttft_s'], 'p99')}",
            _ms(s["tpot_s"], "p99"), _ms(s["itl_s"], "max"), _s(s["e2e_s"], "p99"),
            f"{s['throughput']['output_tokens_per_s']:.0f}"]


def sweep_table(directories: Sequence[pathlib.Path]) -> str:
    """One row per (directory, policy): the capacity sweep's view."""
    from ops.loadgen.report import read_run
    from policy.baselines import POLICY_NAMES

    headers = ["TTFT p50 / p99 (ms)", "TPOT p99 (ms)", "ITL max (ms)", "E2E p99 (s)",
               "output tok/s"]
    lines = ["| run | policy | " + " | ".join(headers) + " |",
             "|---" * (len(headers) + 2) + "|"]
    for directory in directories:
        for name in POLICY_NAMES:
            path = directory / f"{name}.json"
            if path.exists():
                s = read_run(path).summary
                lines.append(f"| {directory.name} | {name} | " + " | ".join(_sweep_row(s)) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.tabulate is not None:
        try:
            if len(args.tabulate) > 1:
                print(sweep_table(args.tabulate))
            else:
                print(tabulate(args.tabulate[0]))
        except (ValueError, OSError) as exc:
            print(f"flare bench compare: {exc}", file=sys.stderr)
            return 2
        return 0
    from ops.loadgen.report import write_run
    from ops.sim.workloads import build_workload

    try:
        if args.concurrency is not None and args.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        spec = _workload(args)
    except ValueError as exc:
        print(f"flare bench compare: {exc}", file=sys.stderr)
        return 2
    plans = build_workload(spec)
    summaries: dict[str, Any] = {}
    for policy in args.policy:
        print(f"{policy}: load average {os.getloadavg()[0]:.2f}, {len(plans)} requests",
              file=sys.stderr)
        try:
            run = run_policy(policy, args, spec, plans)
        except launch.LaunchError as exc:
            print(f"flare bench compare: {policy}: {exc}", file=sys.stderr)
            return 1
        write_run(args.output_dir / f"{policy}.json", run)
        summaries[policy] = {"config": run.config, "summary": run.summary}
        print(f"{policy}: done in {run.summary['duration_s']:.1f} s", file=sys.stderr)
    (args.output_dir / "compare.json").write_text(json.dumps(summaries, indent=1) + "\n")
    print(tabulate(args.output_dir))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="flare bench compare", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
