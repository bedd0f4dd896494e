"""``flare sim`` end to end on a tiny workload: exit status, files, table, errors.

Simulator outputs: per-policy run files readable by the load benchmark's
``read_run``, ``sim.json`` with summaries labelled synthetic and the printed summary
naming its synthetic costs (VER-36), and clear usage errors.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from ops import sim_command
from ops.loadgen.report import read_run


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sim_command.add_arguments(parser)
    return sim_command.main(parser.parse_args(argv))


@pytest.mark.slow
def test_sim_command_writes_run_files_and_summary(tmp_path: pathlib.Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    code = run(["--scenario", "fairness", "--num-requests", "12", "--max-batch", "4",
                "--prefill-capacity", "64", "256", "--policy", "balanced", "fcfs", "vtc",
                "--token-budget", "256", "--noise", "0.1", "--output-dir", str(out),
                "--no-plots"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "synthetic costs" in printed and "vtc" in printed
    data = json.loads((out / "sim.json").read_text())
    assert data["synthetic"] is True
    assert set(data["policies"]) == {"balanced", "fcfs", "vtc"}
    for name in ("balanced", "fcfs", "vtc"):
        run_file = read_run(out / f"{name}.json")
        assert run_file.label == name
        assert run_file.summary["requests"]["ok"] == 12
        assert set(run_file.summary["per_client"]) == {"heavy", "light"}
        assert run_file.summary["simulator"]["unfinished"] == 0
    assert not (out / "latency_cdf.png").exists()


def test_sim_command_reports_bad_inputs(tmp_path: pathlib.Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--costs", str(tmp_path / "missing.json"), "--num-requests", "2"]) == 2
    assert "flare sim:" in capsys.readouterr().err
    assert run(["--max-batch", "3", "--num-requests", "2"]) == 2
    assert run(["--policy", "sarathi", "--token-budget", "8", "--num-requests", "2",
                "--output-dir", str(tmp_path), "--no-plots"]) == 2
    assert "token budget" in capsys.readouterr().err


@pytest.mark.slow
def test_sim_command_draws_plots(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "plots"
    assert run(["--num-requests", "6", "--max-batch", "2", "--prefill-capacity", "64",
                "--no-mixed-prefill", "--policy", "fcfs", "sarathi", "--token-budget", "64",
                "--output-dir", str(out)]) == 0
    for name in ("latency_cdf.png", "tokens_over_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_command_compares_speculation_and_prints_time_per_policy(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The acceptance scenario: the seed's speculative scheduler against fixed-spec-K and
    a non-speculative policy, each on its own catalog; speculation statistics in the
    run files; one timing line per policy on stdout."""
    out = tmp_path / "acc"
    code = run(["--scenario", "acceptance", "--num-requests", "8", "--max-batch", "2",
                "--prefill-capacity", "64", "256", "--draft-depth", "2",
                "--client-acceptance", "code:1.0,chat:0.0", "--policy", "sarathi",
                "spec-adaptive", "fixed-spec-2", "--output-dir", str(out), "--no-plots"])
    assert code == 0
    printed = capsys.readouterr().out
    timing = printed.split("time per policy:")[1]
    for name in ("sarathi", "spec-adaptive", "fixed-spec-2"):
        assert f"  {name}: " in timing and "us CPU per frame" in timing
    data = json.loads((out / "sim.json").read_text())
    assert data["workload"]["client_acceptance"] == {"code": 1.0, "chat": 0.0}
    fixed = data["policies"]["fixed-spec-2"]["simulator"]
    assert fixed["speculation"]["rounds"] > 0 and fixed["elapsed_s"] > 0
    assert data["policies"]["sarathi"]["simulator"]["speculation"]["rounds"] == 0
    # depth 3 does not fit a depth-2 load: a clear error, nothing simulated
    assert run(["--num-requests", "2", "--draft-depth", "2", "--policy", "fixed-spec-3",
                "--output-dir", str(tmp_path / "x"), "--no-plots"]) == 2
    assert "fixed-spec-3 needs" in capsys.readouterr().err


def test_sim_command_cost_model_and_one_running_limit(tmp_path: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--cost-model`` picks the roofline (labelled synthetic, VER-36); the running
    limit defaults to ``--max-batch`` and ``--max-running`` sets it for every policy."""
    out = tmp_path / "roof"
    assert run(["--num-requests", "4", "--max-batch", "4", "--prefill-capacity", "64", "256",
                "--policy", "balanced", "fcfs", "--cost-model", "roofline-llama3-8b-h100",
                "--output-dir", str(out), "--no-plots"]) == 0
    assert "synthetic costs (roofline Llama-3-8B on H100 SXM)" in capsys.readouterr().out
    data = json.loads((out / "sim.json").read_text())
    assert data["synthetic"] is True and data["costs"]["source"].startswith("roofline")
    assert data["config"]["max_running"] == 4 and data["options"]["max_resident"] == 4
    assert run(["--num-requests", "4", "--max-batch", "4", "--prefill-capacity", "64",
                "--policy", "fcfs", "--max-running", "2", "--output-dir", str(out),
                "--no-plots"]) == 0
    assert json.loads((out / "sim.json").read_text())["options"]["max_resident"] == 2
    assert run(["--num-requests", "4", "--max-running", "0", "--output-dir", str(out)]) == 2
    assert "--max-running" in capsys.readouterr().err
