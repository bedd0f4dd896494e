"""Run files and plots: one JSON per run, PNG figures overlaying any number of runs.

A run file holds a ``label`` (e.g. the scheduler policy), the run's configuration, the
``summary`` from ``metrics.summarize`` and every per-request record, so plots and new
metrics can be recomputed later from files alone. Plots use matplotlib's Agg backend (no
display needed): latency CDFs with one curve per run label, and output tokens delivered over
time (per run, and per client when a run has several).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops.loadgen.records import RequestRecord

RUN_FILE_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFile:
    """One run as stored: label, configuration, summary and records."""

    label: str
    config: dict[str, Any]
    summary: dict[str, Any]
    records: tuple[RequestRecord, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": RUN_FILE_VERSION,
            "label": self.label,
            "config": self.config,
            "summary": self.summary,
            "records": [r.to_json() for r in self.records],
        }


def write_run(path: pathlib.Path, run: RunFile) -> None:
    """Write ``run`` as JSON: the header indented, one line per request record (an
    indented record puts every chunk time on its own line: slow and huge)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = run.to_json()
    records = data.pop("records")
    head = json.dumps(data, indent=1, allow_nan=True)
    lines = ",\n  ".join(json.dumps(r, allow_nan=True) for r in records)
    body = f'{head[:-2]},\n "records": [\n  {lines}\n ]\n}}\n' if records else \
        f'{head[:-2]},\n "records": []\n}}\n'
    path.write_text(body)


def read_run(path: pathlib.Path) -> RunFile:
    data = json.loads(path.read_text())
    if data.get("version") != RUN_FILE_VERSION:
        raise ValueError(
            f"{path}: not a flare load-benchmark run file (version {RUN_FILE_VERSION})"
        )
    return RunFile(
        label=str(data["label"]),
        config=dict(data["config"]),
        summary=dict(data["summary"]),
        records=tuple(RequestRecord.from_json(r) for r in data["records"]),
    )


def _ok(run: RunFile) -> list[RequestRecord]:
    return [r for r in run.records if r.status == "ok"]


# (title, per-run sample extractor) for each latency panel.
LATENCY_PANELS: tuple[tuple[str, Callable[[RunFile], list[float]]], ...] = (
    ("time to first token (s)", lambda run: [t for r in _ok(run) if (t := r.ttft_s) is not None]),
    ("time per output token (s)", lambda run: [t for r in _ok(run) if (t := r.tpot_s) is not None]),
    (
        "inter-token latency per chunk (s)",
        lambda run: [g for r in _ok(run) for g in r.chunk_gaps_s()],
    ),
    ("end-to-end latency (s)", lambda run: [t for r in _ok(run) if (t := r.e2e_s) is not None]),
)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(runs: Sequence[RunFile], path: pathlib.Path) -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E, one curve per run label."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (title, extract) in zip(axes.flat, LATENCY_PANELS, strict=True):
        for run in runs:
            samples = np.sort(np.asarray(extract(run), dtype=float))
            if samples.size == 0:
                continue
            fraction = np.arange(1, samples.size + 1) / samples.size
            ax.step(samples, fraction, where="post", label=run.label)
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.has_data():
            # A fixed corner: "best" searches every plotted point (slow, and it warns).
            ax.legend(fontsize="small", loc="lower right")
    fig.suptitle("latency CDFs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def delivered_curve(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(times, cumulative output tokens) over every chunk of ``records``, in time order."""
    pairs = sorted(
        (t, k) for r in records for t, k in zip(r.chunk_times_s, r.chunk_tokens, strict=True)
    )
    times = np.asarray([t for t, _ in pairs], dtype=float)
    tokens = np.cumsum(np.asarray([k for _, k in pairs], dtype=float))
    return times, tokens


def plot_tokens_over_time(runs: Sequence[RunFile], path: pathlib.Path) -> None:
    """Cumulative output tokens delivered vs time: per run (left), per run and client (right)."""
    plt = _pyplot()
    fig, (total_ax, client_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        times, tokens = delivered_curve(run.records)
        if times.size:
            total_ax.step(times, tokens, where="post", label=run.label)
        for client in sorted({r.client for r in run.records}):
            times, tokens = delivered_curve([r for r in run.records if r.client == client])
            if times.size:
                client_ax.step(times, tokens, where="post", label=f"{run.label} / {client}")
    for ax, title in ((total_ax, "all clients"), (client_ax, "per client")):
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("output tokens delivered")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(runs: Sequence[RunFile]) -> str:
    """A plain-text comparison of the headline numbers of each run."""
    rows = [
        (
            "label",
            "ok/sent",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "ITL p99",
            "E2E p99",
            "goodput",
            "Jain",
            "QoE mean",
        )
    ]

    def fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
        return "-" if value is None else f"{value * scale:.{digits}g}"

    for run in runs:
        s = run.summary
        rows.append(
            (
                run.label,
                f"{s['requests']['ok']}/{s['requests']['sent']}",
                fmt(s["throughput"]["requests_per_s"]),
                fmt(s["throughput"]["output_tokens_per_s"]),
                fmt(s["ttft_s"]["median"]),
                fmt(s["ttft_s"]["p99"]),
                fmt(s["tpot_s"]["median"]),
                fmt(s["itl_s"]["p99"]),
                fmt(s["e2e_s"]["p99"]),
                fmt(s["goodput"]["fraction_of_sent"]),
                fmt(s["fairness"]["jain_service"]),
                fmt(s["qoe"]["mean"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )
