"""Run files, plots and the ``flare bench serve`` command end to end on loopback.

Covers the load benchmark: JSON with every metric and per-request record, PNG latency
CDFs overlaying several runs, tokens-over-time curves, and the command's run/compare modes.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
import trio
from test_loadgen_client import TEST_DEADLINE_S, FakeOpenAI, serving

from ops import bench_serve
from ops.loadgen.metrics import MetricOptions, summarize
from ops.loadgen.records import RequestRecord
from ops.loadgen.report import (
    RunFile,
    delivered_curve,
    plot_latency_cdfs,
    plot_tokens_over_time,
    read_run,
    summary_table,
    write_run,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(
    index: int, client: str, times: tuple[float, ...], tokens: tuple[float, ...], sent: float = 0.0
) -> RequestRecord:
    return RequestRecord(
        index=index,
        client=client,
        scheduled_s=sent,
        sent_s=sent,
        status="ok",
        target_prompt_tokens=4,
        target_output_tokens=len(times),
        prompt_tokens=4,
        chunk_times_s=times,
        chunk_tokens=tokens,
        finished_s=times[-1],
    )


def run_file(label: str, scale: float) -> RunFile:
    records = (
        record(0, "a", (0.1 * scale, 0.2 * scale, 0.3 * scale), (1, 1, 1)),
        record(1, "b", (0.15 * scale, 0.5 * scale), (2, 1), sent=0.05),
    )
    summary = summarize(records, duration_s=0.5 * scale, planned=2, options=MetricOptions())
    return RunFile(label=label, config={"rate": 1.0}, summary=summary, records=records)


def test_run_file_round_trips(tmp_path: pathlib.Path) -> None:
    run = run_file("balanced", 1.0)
    path = tmp_path / "sub" / "balanced.json"
    write_run(path, run)
    assert read_run(path) == run
    data = json.loads(path.read_text())
    assert data["summary"]["requests"]["ok"] == 2
    assert len(data["records"]) == 2 and data["records"][1]["chunk_tokens"] == [2, 1]


def test_reading_a_foreign_json_file_fails_clearly(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a flare load-benchmark run file"):
        read_run(path)


def test_delivered_curve_merges_chunks_in_time_order() -> None:
    times, tokens = delivered_curve(run_file("x", 1.0).records)
    assert times.tolist() == pytest.approx([0.1, 0.15, 0.2, 0.3, 0.5])
    assert tokens.tolist() == pytest.approx([1, 3, 4, 5, 6])


@pytest.mark.slow
def test_plots_overlay_several_runs(tmp_path: pathlib.Path) -> None:
    runs = [run_file("balanced", 1.0), run_file("fcfs", 2.0)]
    plot_latency_cdfs(runs, tmp_path / "cdf.png")
    plot_tokens_over_time(runs, tmp_path / "tokens.png")
    for name in ("cdf.png", "tokens.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    table = summary_table(runs).splitlines()
    assert len(table) == 3
    assert table[1].split()[0] == "balanced" and table[2].split()[0] == "fcfs"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.slow
async def test_bench_serve_command_runs_writes_and_compares(tmp_path: pathlib.Path) -> None:
    app = FakeOpenAI()
    out = tmp_path / "results"
    with trio.fail_after(TEST_DEADLINE_S * 2):
        async with serving(app) as url:
            args = parse(
                [
                    "--base-url",
                    url,
                    "--num-requests",
                    "6",
                    "--rate",
                    "inf",
                    "--clients",
                    "a:2,b:1",
                    "--lengths",
                    "uniform",
                    "--prompt-min",
                    "3",
                    "--prompt-max",
                    "6",
                    "--output-min",
                    "2",
                    "--output-max",
                    "4",
                    "--model-dir",
                    str(tmp_path),
                    "--ttft-slo",
                    "5",
                    "--tpot-slo",
                    "1",
                    "--label",
                    "first",
                    "--output-dir",
                    str(out),
                    "--time-limit",
                    "20",
                ]
            )
            # The command calls trio.run itself, so it runs in a worker thread here.
            code = await trio.to_thread.run_sync(bench_serve.main, args)
    assert code == 0
    run = read_run(out / "first.json")
    assert run.summary["requests"]["ok"] == 6
    assert set(run.summary["fairness"]["clients"]) == {"a", "b"}
    assert run.summary["goodput"]["good_requests"] == 6
    assert run.config["prompt_builder"].startswith("word-based")
    assert run.config["model"] == "fake-model"
    assert sorted(b["user"] for b in app.bodies) == ["a"] * 4 + ["b"] * 2
    for name in ("latency-cdf.png", "tokens-over-time.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC

    replot = tmp_path / "replot"
    args = parse(
        [
            "--no-run",
            "--compare",
            str(out / "first.json"),
            str(out / "first.json"),
            "--output-dir",
            str(replot),
        ]
    )
    assert bench_serve.main(args) == 0
    assert (replot / "latency-cdf.png").read_bytes()[:8] == PNG_MAGIC
    assert not (replot / "run.json").exists()


def test_no_run_without_files_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_serve.main(parse(["--no-run"])) == 2
    assert "nothing to report" in capsys.readouterr().err


def test_bad_options_and_files_are_usage_errors(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_serve.main(parse(["--clients", "a:0", "--output-dir", str(tmp_path)])) == 2
    assert "bad client spec" in capsys.readouterr().err
    assert bench_serve.main(parse(["--no-run", "--compare", str(tmp_path / "missing.json")])) == 2
    assert "missing.json" in capsys.readouterr().err
