"""``flare bench compare``: the side-by-side tables of docs/benchmarks.md.

The server-driving half needs a model server per policy and is exercised by the
commands in docs/benchmarks.md; here the tabulation is checked on real run files
written by ``flare sim`` (the same run-file format the driver writes).
"""

from __future__ import annotations

import argparse
import pathlib

import pytest

from ops import bench_compare, sim_command


def _simulate(out: pathlib.Path, scenario: str, policies: list[str], n: int = 8) -> None:
    parser = argparse.ArgumentParser()
    sim_command.add_arguments(parser)
    args = parser.parse_args(["--scenario", scenario, "--num-requests", str(n), "--max-batch", "4",
                              "--prefill-capacity", "64", "256", "--policy", *policies,
                              "--output-dir", str(out), "--no-plots"])
    assert sim_command.main(args) == 0


def test_tabulate_gives_one_row_per_policy_with_per_client_columns(
        tmp_path: pathlib.Path) -> None:
    _simulate(tmp_path / "fair", "fairness", ["fcfs", "vtc"], n=24)
    table = bench_compare.tabulate(tmp_path / "fair").splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["fcfs", "vtc"]
    header = table[0]
    assert "light" in header and "heavy" in header  # the fairness view splits by client
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_sweep_table_rows_per_run_and_policy(tmp_path: pathlib.Path) -> None:
    for rate in ("2", "4"):
        _simulate(tmp_path / f"rate{rate}", "poisson", ["fcfs", "sarathi"])
    table = bench_compare.sweep_table([tmp_path / "rate2", tmp_path / "rate4"]).splitlines()
    rows = [tuple(cell.strip() for cell in line.split("|")[1:3]) for line in table[2:]]
    assert rows == [("rate2", "fcfs"), ("rate2", "sarathi"), ("rate4", "fcfs"),
                    ("rate4", "sarathi")]


def test_tabulate_refuses_a_directory_without_runs(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"no <policy>\.json run files"):
        bench_compare.tabulate(tmp_path)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_compare.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_fixed_lengths_and_streams_and_the_extension_presets_are_accepted() -> None:
    from ops.sim.workloads import build_workload

    args = _args("--scenario", "poisson", "--num-requests", "12", "--prompt-tokens", "64",
                 "--output-tokens", "32", "--concurrency", "4",
                 "--policy", "balanced", "client-fair", "first-token", "fcfs")
    plans = build_workload(bench_compare._workload(args))
    assert len(plans) == 12
    assert {(p.prompt_tokens, p.output_tokens) for p in plans} == {(64, 32)}
    assert args.concurrency == 4
    assert args.policy == ["balanced", "client-fair", "first-token", "fcfs"]


def test_long_prompt_period_sets_how_often_a_long_prompt_arrives() -> None:
    from ops.sim.workloads import build_workload

    def longs(*flags: str) -> int:
        plans = build_workload(bench_compare._workload(_args(
            "--num-requests", "40", "--rate", "4", *flags)))
        return sum(p.client == "long" for p in plans)

    assert longs("--long-prompt-every", "2") > longs() >= 1


def test_bad_stream_or_length_flags_exit_2_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_compare.main(_args("--prompt-tokens", "64")) == 2
    assert "--prompt-tokens and --output-tokens" in capsys.readouterr().err
    assert bench_compare.main(_args("--concurrency", "0")) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert bench_compare.main(_args("--long-prompt-every", "0")) == 2
    assert "--long-prompt-every must be positive" in capsys.readouterr().err
    assert bench_compare.main(_args("--scenario", "poisson", "--long-prompt-every", "2")) == 2
    assert "--scenario interference" in capsys.readouterr().err
