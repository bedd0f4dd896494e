"""What ``flare sim-capacity`` writes: the capacity table, the JSON and the Pareto plot.

``capacity.md`` has one row per configuration and one column per scenario (capacity in
requests per second at the SLO), then the seed presets' ratio to the best baseline in
each scenario (and, for the speculating seed presets, to the best fixed-depth speculation
baseline). ``capacity.json`` holds the settings, every search (rates tried and
their attainment) and the metrics of the run at each capacity (TTFT by prompt length,
ITL maximum, per-client latency and attainment), and the Pareto points. ``pareto.png``
plots TTFT p99 against TPOT p99 of every configuration at one rate per scenario.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from ops.sim.capacity import (
    is_baseline,
    is_speculative_baseline,
    ratio_to_best_baseline,
    speculates,
)


def capacity_table(results: Sequence[Mapping[str, Any]], scenarios: Sequence[str],
                   configurations: Sequence[str]) -> str:
    """The Markdown capacity table (requests/s) with the seed presets' ratios."""
    cap = {(r["configuration"], r["scenario"]): float(r["capacity_rps"]) for r in results}
    lines = ["| configuration | " + " | ".join(scenarios) + " |",
             "|---|" + "---:|" * len(scenarios)]
    for label in configurations:
        cells = [f"{cap[(label, s)]:.2f}" if (label, s) in cap else "-" for s in scenarios]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    compared = [s for s in configurations if not _is_any_baseline(s)]
    for name, baseline, labels in (
            ("best baseline", is_baseline, compared),
            ("best fixed-spec", is_speculative_baseline, [s for s in compared if speculates(s)])):
        for seed in labels:
            cells = []
            for s in scenarios:
                ratio = ratio_to_best_baseline(
                    {label: c for (label, sc), c in cap.items() if sc == s}, seed,
                    baseline=baseline)
                cells.append("-" if ratio is None else f"{ratio:.2f}x")
            if any(c != "-" for c in cells):  # no row when no such baseline ran
                lines.append(f"| {seed} / {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _is_any_baseline(label: str) -> bool:
    return is_baseline(label) or is_speculative_baseline(label)


def pareto_points(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """(configuration, scenario, rate, TTFT p99, TPOT p99, attainment) of each run."""
    return [{"configuration": r["configuration"], "scenario": r["scenario"],
             "rate": r["rate"], "ttft_p99_s": r["ttft_s"]["p99"],
             "tpot_p99_s": r["tpot_s"]["p99"], "attainment": r["attainment"]}
            for r in runs]


def plot_pareto(points: Sequence[Mapping[str, Any]], scenarios: Sequence[str],
                path: pathlib.Path, *, title: str) -> None:
    """One panel per scenario: TTFT p99 against TPOT p99, one labelled point per
    configuration (lower-left is better on both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(scenarios)) or 1
    rows = math.ceil(len(scenarios) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(scenarios):]:
        ax.set_visible(False)
    for ax, scenario in zip(axes.flat, scenarios, strict=False):
        mine = [p for p in points if p["scenario"] == scenario
                and p["ttft_p99_s"] is not None and p["tpot_p99_s"] is not None]
        for p in mine:
            seed = not _is_any_baseline(p["configuration"])
            ax.scatter(p["tpot_p99_s"] * 1e3, p["ttft_p99_s"] * 1e3,
                       marker="*" if seed else "o", s=140 if seed else 50,
                       color="tab:red" if seed else "tab:blue")
            ax.annotate(p["configuration"], (p["tpot_p99_s"] * 1e3, p["ttft_p99_s"] * 1e3),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        rate = mine[0]["rate"] if mine else float("nan")
        ax.set_title(f"{scenario} at {rate:.2f} req/s", fontsize=9)
        ax.set_xlabel("TPOT p99 (ms)")
        ax.set_ylabel("TTFT p99 (ms)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out_dir: pathlib.Path, *, settings: Mapping[str, Any],
                 results: Sequence[Mapping[str, Any]], pareto: Sequence[Mapping[str, Any]],
                 scenarios: Sequence[str], configurations: Sequence[str],
                 plot: bool = True, appendix: str = "") -> list[pathlib.Path]:
    """Write ``capacity.md`` (the table, then ``appendix``), ``capacity.json`` and
    (unless ``plot`` is off) ``pareto.png``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = capacity_table(results, scenarios, configurations)
    md = out_dir / "capacity.md"
    md.write_text(table + ("\n" + appendix if appendix else ""))
    points = pareto_points(pareto)
    js = out_dir / "capacity.json"
    js.write_text(json.dumps({"settings": dict(settings), "table": table,
                              "results": list(results), "pareto": points},
                             indent=1, allow_nan=True) + "\n")
    written = [md, js]
    if plot:
        png = out_dir / "pareto.png"
        plot_pareto(points, scenarios, png,
                    title=f"{settings.get('cost_source', '')}: TTFT p99 vs TPOT p99")
        written.append(png)
    return written
