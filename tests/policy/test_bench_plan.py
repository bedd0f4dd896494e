"""``flare bench plan`` runs the production scheduler end to end (a smoke run; the
timing figures themselves are recorded in docs/benchmarks-plan.md, not asserted)."""

from __future__ import annotations

import argparse

from ops.bench_plan import main, realistic_catalog, run


def test_bench_plan_catalog_and_run() -> None:
    assert len(realistic_catalog()) >= 100
    result = run(iterations=40, population=64, seed=3)
    assert len(result["plan"]) == 40 and len(result["complete"]) > 0
    assert max(result["lanes"]) <= 64


def test_bench_plan_main_prints_figures(capsys: object) -> None:
    parser = argparse.ArgumentParser()
    from ops.bench_plan import add_arguments

    add_arguments(parser)
    assert main(parser.parse_args(["--iterations", "10", "--requests", "8"])) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "plan() wall: p50" in out and "complete() cpu: p50" in out


def test_bench_plan_times_commit_with_the_cpu_backends_speed_factor(capsys: object) -> None:
    parser = argparse.ArgumentParser()
    from ops.bench_plan import add_arguments

    add_arguments(parser)
    args = ["--iterations", "10", "--requests", "4", "--cost-drift-weight"]
    assert main(parser.parse_args([*args, "0.1"])) == 0
    assert "commit() cpu: p50" in capsys.readouterr().out  # type: ignore[attr-defined]
    assert main(parser.parse_args([*args, "2"])) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "--cost-drift-weight" in err and "at most 1" in err
