"""Run several policies on one simulated workload and write what ``flare sim`` reports.

For each policy a fresh planner (``policy.baselines.make_policy``) runs the same request
list on the same cost table with the same seed, on the catalog its server would load
(``ops.sim.catalogs``: speculative policies on the speculative load). Each run becomes an
``ops.loadgen.report.RunFile`` (label = policy, summary from the load benchmark's
``summarize``: TTFT, TPOT, ITL, E2E, throughput, goodput, Jain's fairness, QoE), so run
files, plots and tables are interchangeable with ``flare bench serve`` output. The
output directory receives ``<policy>.json`` per policy, ``sim.json`` (workload, options,
cost table, every policy's summary and simulator statistics) and, unless disabled,
``latency_cdf.png`` and ``tokens_over_time.png``.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops.loadgen.metrics import MetricOptions, distribution, summarize, token_weighted_itl
from ops.loadgen.records import RequestRecord
from ops.loadgen.report import (
    RunFile,
    plot_latency_cdfs,
    plot_tokens_over_time,
    summary_table,
    write_run,
)
from ops.loadgen.workload import RequestPlan
from ops.sim.catalogs import Catalogs
from ops.sim.costs import CostTable
from ops.sim.engine import SimOptions, SimResult, simulate
from ops.sim.workloads import WorkloadSpec
from policy.baselines import BaselinePolicy, make_policy

SIM_FILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class PolicyRun:
    label: str
    result: SimResult
    run: RunFile
    elapsed_s: float
    """Host seconds for this policy: simulation plus metrics."""
    elapsed_cpu_s: float

    def timing_line(self) -> str:
        r = self.result
        frames = sum(r.frames.values())
        per_frame = r.cpu_s / frames * 1e6 if frames else 0.0
        return (f"{self.label}: {self.elapsed_s:.2f} s ({self.elapsed_cpu_s:.2f} s CPU) "
                f"for {len(r.records)} requests; simulation {r.wall_s:.2f} s "
                f"({r.cpu_s:.2f} s CPU, {frames} frames, {per_frame:.0f} us CPU per frame, "
                f"{r.plan_calls} plan() calls)")


def run_policies(
    policies: Sequence[str], *, requests: Sequence[RequestPlan], catalogs: Catalogs,
    costs: CostTable, options: SimOptions, metrics: MetricOptions, token_budget: int,
    config: dict[str, Any], progress: Callable[[str], None] | None = None,
) -> list[PolicyRun]:
    """Simulate ``requests`` under each policy in turn, each on its own catalog."""
    runs = []
    for name in policies:
        started, cpu_started = time.perf_counter(), time.process_time()
        planner = make_policy(name, catalog=options.vision.catalog(catalogs.for_policy(name)),
                              token_budget=token_budget)
        if isinstance(planner, BaselinePolicy):
            # the simulator admits at most max_resident requests for every policy; a
            # baseline's own running limit could otherwise differ from it
            planner.limit_running(options.max_resident)
        result = simulate(planner, requests, costs, options)
        summary = summarize(result.records, duration_s=result.makespan_s,
                            planned=len(requests), options=metrics)
        summary["simulator"] = result.stats_json()
        summary["per_client"] = per_client_latency(result.records)
        run = RunFile(label=name, config={**config, "policy": name}, summary=summary,
                      records=result.records)
        done = PolicyRun(name, result, run, time.perf_counter() - started,
                         time.process_time() - cpu_started)
        summary["simulator"]["elapsed_s"] = done.elapsed_s
        summary["simulator"]["elapsed_cpu_s"] = done.elapsed_cpu_s
        runs.append(done)
        if progress is not None:
            progress(done.timing_line())
    return runs


def per_token_gaps_s(records: Sequence[RequestRecord]) -> list[float]:
    """The chunk gaps of ``records`` counted per token: a gap ``g`` after which a chunk
    delivers ``n`` tokens counts as ``n`` intervals of ``g / n`` (a one-token chunk keeps
    its gap, so one-token streams give the per-chunk gaps). Empty unless every count is
    whole, as the simulator's are (the load benchmark's rescaled counts need not be)."""
    values, weights = token_weighted_itl(records)
    counts = np.rint(weights).astype(int)
    if not np.array_equal(counts, weights):
        return []
    return [float(v) for v in np.repeat(values, counts)]


def per_client_latency(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    """TTFT, TPOT, per-chunk ITL, per-token ITL (``per_token_gaps_s``) and E2E
    distributions per client tag.

    Separates the chat traffic from the long prompts of the interference scenario and
    the heavy from the light client of the fairness one.
    """
    out: dict[str, dict[str, Any]] = {}
    for client in sorted({r.client for r in records}):
        ok = [r for r in records if r.client == client and r.status == "ok"]
        out[client] = {
            "requests": len(ok),
            "ttft_s": distribution(t for r in ok if (t := r.ttft_s) is not None),
            "tpot_s": distribution(t for r in ok if (t := r.tpot_s) is not None),
            "itl_s": distribution(g for r in ok for g in r.chunk_gaps_s()),
            "itl_token_s": distribution(per_token_gaps_s(ok)),
            "e2e_s": distribution(t for r in ok if (t := r.e2e_s) is not None),
        }
    return out


def write_outputs(out_dir: pathlib.Path, runs: Sequence[PolicyRun], *, workload: WorkloadSpec,
                  options: SimOptions, costs: CostTable, config: dict[str, Any],
                  plots: bool = True) -> list[pathlib.Path]:
    """Write the per-policy run files, ``sim.json`` and the plots; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for r in runs:
        path = out_dir / f"{r.label}.json"
        write_run(path, r.run)
        written.append(path)
    combined = {
        "version": SIM_FILE_VERSION,
        "synthetic": costs.synthetic,
        "config": config,
        "workload": workload.to_json(),
        "options": options.to_json(),
        "costs": costs.to_json(),
        "policies": {r.label: r.run.summary for r in runs},
        "table": summary_table([r.run for r in runs]),
    }
    path = out_dir / "sim.json"
    path.write_text(json.dumps(combined, indent=1, allow_nan=True) + "\n")
    written.append(path)
    if plots:
        run_files = [r.run for r in runs]
        plot_latency_cdfs(run_files, out_dir / "latency_cdf.png")
        plot_tokens_over_time(run_files, out_dir / "tokens_over_time.png")
        written += [out_dir / "latency_cdf.png", out_dir / "tokens_over_time.png"]
    return written
