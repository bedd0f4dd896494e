"""Smoke test of ``flare bench speculation`` on a tiny random Llama
pair built with ``save_pretrained``: one row per mode and load, positive figures, and
greedy speculative output counted in full. Covers SPEC-5 (speculation modes selectable
side by side) as exercised by the benchmark; speed targets live in the benchmark."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from actors.config import DEFAULT_DRAFT_CATCH_UP
from ops import bench_speculation, bench_speculation_rows

pytestmark = pytest.mark.slow


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_speculation.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_modes_cover_off_each_fixed_depth_and_adaptive_per_source() -> None:
    modes = bench_speculation.modes_of(_args("--depths", "1,3", "--sources", "draft,copy"))
    assert [m.label() for m in modes] == [
        "off", "draft:d1", "draft:d3", "draft:adaptive<=d3",
        "copy:d1", "copy:d3", "copy:adaptive<=d3"]
    with_seed = bench_speculation.modes_of(_args("--depths", "2", "--sources", "copy",
                                                 "--seed-adaptive"))
    assert [m.label() for m in with_seed] == [
        "off", "copy:d2", "copy:adaptive<=d2", "copy:adaptive<=d2,acc9"]
    assert [m.counterfactuals for m in with_seed] == [True, True, True, False]


def test_lagging_adaptive_adds_a_learned_mode_with_its_catch_up(tmp_path: Path) -> None:
    """``--lagging-adaptive K`` runs learned adaptive twice: with the command's draft
    context (maintained by default) and with a lagging one catching up K positions."""
    args = _args("--depths", "2", "--sources", "draft", "--lagging-adaptive", "16")
    configs = {m.label(): bench_speculation.runtime_config(m, args, tmp_path, tmp_path)
               for m in bench_speculation.modes_of(args)}
    assert list(configs) == ["off", "draft:d2", "draft:adaptive<=d2", "draft:adaptive<=d2,lag<=16"]
    assert configs["draft:adaptive<=d2,lag<=16"].draft_catch_up == 16
    assert configs["draft:adaptive<=d2"].draft_catch_up == DEFAULT_DRAFT_CATCH_UP == 0
    lagging_everywhere = _args("--depths", "2", "--sources", "draft", "--draft-catch-up", "4")
    assert {bench_speculation.runtime_config(m, lagging_everywhere, tmp_path, tmp_path)
            .draft_catch_up for m in bench_speculation.modes_of(lagging_everywhere)} == {4}


def test_adaptive_options_reach_only_the_adaptive_runtimes(tmp_path: Path) -> None:
    args = _args("--depths", "2", "--sources", "copy", "--seed-adaptive",
                 "--speculative-allocation", "device", "--mtp-adaptive-verification-alpha", "2")
    configs = {m.label(): bench_speculation.runtime_config(m, args, tmp_path, tmp_path)
               for m in bench_speculation.modes_of(args)}
    adaptive, seed_only = configs["copy:adaptive<=d2"], configs["copy:adaptive<=d2,acc9"]
    assert (adaptive.speculative_allocation,
            adaptive.adaptive_verification_alpha) == ("device", 2.0)
    assert adaptive.copy_counterfactuals and not seed_only.copy_counterfactuals
    for fixed in (configs["off"], configs["copy:d2"]):
        assert (fixed.speculative_allocation, fixed.adaptive_verification_alpha) == ("host", None)
    assert configs["copy:d2"].draft_depth == 2 and configs["copy:d2"].speculation == "fixed"


def test_adaptive_policies_run_each_adaptive_mode_under_each_preset(tmp_path: Path) -> None:
    """``--adaptive-policies balanced,throughput``: adaptive runs once per preset, in the
    same run as the fixed depths, which keep the command's ``--scheduler-policy``."""
    args = _args("--depths", "2", "--sources", "draft",
                 "--adaptive-policies", "balanced,throughput")
    configs = {m.label(): bench_speculation.runtime_config(m, args, tmp_path, tmp_path)
               for m in bench_speculation.modes_of(args)}
    assert list(configs) == ["off", "draft:d2", "draft:adaptive<=d2,balanced",
                             "draft:adaptive<=d2,throughput"]
    assert {label: c.scheduler_policy for label, c in configs.items()} == {
        "off": "balanced", "draft:d2": "balanced",
        "draft:adaptive<=d2,balanced": "balanced",
        "draft:adaptive<=d2,throughput": "throughput"}
    with pytest.raises(SystemExit):
        _args("--adaptive-policies", "balanced,fastest")


def test_mixed_prefill_reaches_every_mode(tmp_path: Path) -> None:
    """``--mixed-prefill`` loads mixed programs in every mode (so speculative modes plan
    speculative mixed rows, MIX-43); without it none does."""
    for flag, want in (((), False), (("--mixed-prefill",), True)):
        args = _args("--depths", "2", "--sources", "draft", *flag)
        assert {bench_speculation.runtime_config(m, args, tmp_path, tmp_path).mixed_prefill
                for m in bench_speculation.modes_of(args)} == {want}


def test_spec_5_table_has_one_row_per_mode_and_load_with_positive_figures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    threads = torch.get_num_threads()
    try:
        code = bench_speculation.main(_args(
            "--tiny", "--depths", "1", "--loads", "1,2", "--max-batch", "2",
            "--prompt-tokens", "8", "--max-tokens", "6", "--requests-per-stream", "2",
            "--warm-up-requests", "1", "--json"))
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    keys = [(r["mode"], r["streams"]) for r in rows]
    expected_modes = ["off", "draft:d1", "draft:adaptive<=d1", "copy:d1", "copy:adaptive<=d1"]
    assert keys == [(m, n) for m in expected_modes for n in (1, 2)]
    for row in rows:
        # greedy, ignore_eos: every measured request delivers all its tokens
        assert row["tokens"] == 6 * 2 * row["streams"], row
        assert row["tokens_per_s"] > 0 and row["mean_itl_ms"] > 0 and row["seconds"] > 0
        # one token per burst at most as often as one burst per token: gap >= ITL
        assert row["mean_gap_ms"] >= row["mean_itl_ms"] > 0
        assert 0.0 <= row["acceptance"] <= 1.0
        # Off runs no speculative program; fixed runs nothing but (SPEC-5 modes).
        if row["mode"] == "off":
            assert row["speculative_share"] == 0.0 and row["acceptance"] == 0.0
        elif ":d" in row["mode"]:
            assert row["speculative_share"] > 0.0


def test_render_puts_loads_side_by_side() -> None:
    rows = [bench_speculation_rows.Row(m, n, 10, 1.0, 10.0 * n, 5.0) for m in ("off", "copy:d1")
            for n in (1, 8)]
    lines = bench_speculation_rows.render(rows).splitlines()
    assert "1 stream tok/s" in lines[0] and "8 stream tok/s" in lines[0]
    assert lines[2].split() == ["off", "10.0", "5.00", "0.00", "0.00", "0.00",
                                "80.0", "5.00", "0.00", "0.00", "0.00"]
    assert lines[3].split()[0] == "copy:d1"


def test_target_verdicts_compare_adaptive_with_the_best_fixed_choice() -> None:
    """The speculation target, printed under the table: adaptive against the best of "off"
    and every fixed depth of its source, per load; the seed-only variant is not a
    candidate; at one stream also against "off"."""
    figures = {("off", 1): 100.0, ("copy:d2", 1): 150.0, ("copy:d4", 1): 140.0,
               ("copy:adaptive<=d4", 1): 147.0, ("copy:adaptive<=d4,acc9", 1): 160.0,
               ("off", 8): 500.0, ("copy:d2", 8): 450.0, ("copy:d4", 8): 400.0,
               ("copy:adaptive<=d4", 8): 510.0, ("copy:adaptive<=d4,acc9", 8): 480.0}
    rows = [bench_speculation_rows.Row(m, n, 10, 1.0, v, 5.0) for (m, n), v in figures.items()]
    verdicts = bench_speculation_rows.target_verdicts(rows)
    assert verdicts == [
        "copy:adaptive<=d4 @ 1: -2.0% against the best fixed choice (copy:d2 150.0): "
        "not met; above off",
        "copy:adaptive<=d4 @ 8: +2.0% against the best fixed choice (off 500.0): met"]
    assert bench_speculation_rows.render(rows).splitlines()[-2:] == verdicts
