"""``flare bench peer``: the two loads, the pair summary and a peer that cannot start.

The loads run against the load benchmark's fake OpenAI server (``test_loadgen_client``),
which paces each answer; the whole side-by-side run needs two model servers and is the
command in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import pytest
import trio
from test_loadgen_client import TOKEN_PACE_S, FakeOpenAI, serving

from ops import bench_peer
from ops.loadgen.prompts import WordPrompts
from ops.peer_loads import (
    LoadShape,
    closed_loop_completions,
    fixed_prompts,
    pair_ratios,
    streaming_load,
)

DEADLINE_S = 20


async def test_closed_loop_keeps_streams_requests_in_flight_and_counts_usage_tokens() -> None:
    app = FakeOpenAI()
    shape = LoadShape(streams=3, requests=7, prompt_tokens=5, output_tokens=4)
    prompts = fixed_prompts(WordPrompts(), shape)
    with trio.fail_after(DEADLINE_S):
        async with serving(app) as url:
            result = await closed_loop_completions(url, prompts, shape, timeout_s=10)
    assert (result.answered, result.errors) == (7, 0)
    assert result.completion_tokens == 7 * 4
    assert app.most_in_flight == 3
    # Seven answers on three workers take three rounds of four paces each.
    assert result.wall_s >= 3 * 4 * TOKEN_PACE_S
    assert result.tokens_per_s == pytest.approx(28 / result.wall_s)
    assert all(b["stream"] is False and b["temperature"] == 0.0 for b in app.bodies)
    assert sorted(b["prompt"] for b in app.bodies) == sorted(prompts)  # each exactly once


async def test_streaming_load_reports_latencies_at_fixed_concurrency() -> None:
    app = FakeOpenAI()
    shape = LoadShape(streams=2, requests=4, prompt_tokens=5, output_tokens=3)
    with trio.fail_after(DEADLINE_S):
        async with serving(app) as url:
            summary = await streaming_load(url, WordPrompts(), shape, timeout_s=10)
    assert summary["requests"]["ok"] == 4
    assert summary["ttft_s"]["median"] >= TOKEN_PACE_S
    assert summary["itl_s"]["median"] >= TOKEN_PACE_S * 0.5
    assert all(b["stream"] is True and b["max_tokens"] == 3 for b in app.bodies)


def test_pair_ratios_are_per_pair_and_skip_a_dead_peer() -> None:
    assert pair_ratios([10, 30, 20], [10, 10, 40]) == (0.5, 1.0, 3.0)
    assert pair_ratios([10, 30], [0, 15]) == (2.0, 2.0, 2.0)
    assert all(math.isnan(v) for v in pair_ratios([1.0], [0.0]))


def test_summary_table_shows_medians_ratios_and_answer_lengths() -> None:
    flare = [{"tokens_per_s": 100.0, "errors": 0, "mean_answer_tokens": 8.0},
             {"tokens_per_s": 300.0, "errors": 1, "mean_answer_tokens": 8.0}]
    peer = [{"tokens_per_s": 100.0, "errors": 0, "mean_answer_tokens": 7.0},
            {"tokens_per_s": 100.0, "errors": 0, "mean_answer_tokens": 7.0}]
    summary = bench_peer.summarize_pairs(flare, peer)
    assert (summary["ratio_min"], summary["ratio_median"], summary["ratio_max"]) == (1, 2, 3)
    table = bench_peer.format_tables({"nonstream": {8: summary}})
    row = next(line for line in table.splitlines() if line.startswith("| 8 |"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "8", "200", "100", "1.00, 2.00, 3.00", "8.0 / 7.0", "1 / 0"]


def test_peer_command_fills_port_and_model() -> None:
    command = bench_peer.peer_command("serve --port {port} '{model}'", port=81,
                                      model=pathlib.Path("/m d"))
    assert command == ["serve", "--port", "81", "/m d"]
    with pytest.raises(ValueError, match="--streams"):
        bench_peer.parse_counts("1,x")


def test_a_peer_that_exits_is_reported_before_flare_starts(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_peer.add_arguments(parser)
    args = parser.parse_args([
        "--peer-command", f"{sys.executable} -c 'raise SystemExit(3)'",
        "--output-dir", str(tmp_path), "--startup-timeout", "20"])
    assert bench_peer.main(args) == 1
    err = capsys.readouterr().err
    assert "exited with status 3" in err and str(tmp_path / "peer.log") in err
    assert "starting flare" not in err


@pytest.mark.parametrize("repeat", [False, True], ids=["new-per-pair", "repeated"])
async def test_each_pair_sends_both_servers_prompts_new_to_them(
        tmp_path: pathlib.Path, repeat: bool) -> None:
    """The two loads of a pair carry the same prompts; another pair carries others, so
    no load finds an earlier one's prompts in a prefix cache (``--repeat-prompts``:
    every load the same)."""
    parser = argparse.ArgumentParser()
    bench_peer.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--pairs", "2", "--modes", "nonstream",
                              "--prompt-tokens", "6", "--output-tokens", "2",
                              "--requests-per-stream", "1", *(["--repeat-prompts"] * repeat)])
    app = FakeOpenAI()
    with trio.fail_after(DEADLINE_S):
        async with serving(app) as url:
            await trio.to_thread.run_sync(
                bench_peer.run_pairs, args, url, url, (2,), ("nonstream",))
    prompts = [b["prompt"] for b in app.bodies]
    loads = [sorted(prompts[i:i + 2]) for i in range(0, len(prompts), 2)]
    _warm_flare, _warm_peer, flare_1, peer_1, flare_2, peer_2 = loads
    assert flare_1 == peer_1 and flare_2 == peer_2
    assert (flare_1 == flare_2) is repeat
