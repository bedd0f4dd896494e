"""The long-prompt check of ``flare sim-capacity``: the pure prefill time of a prompt
and the per-configuration verdicts (worst long-prompt TTFT within 4x of it, chat ITL p99
within 1.1x of the best sarathi budget's), and the per-token chat ITL p99 beside the
per-chunk one."""

from __future__ import annotations

from typing import Any

import pytest

from ops.loadgen.records import RequestRecord
from ops.sim.costs import CostTable
from ops.sim.long_prompt_check import long_prompt_rows, long_prompt_table, pure_prefill_ms
from ops.sim.runs import per_client_latency, per_token_gaps_s
from policy.descriptors import GraphKind, GraphShape


def test_pure_prefill_is_the_fastest_single_shape_cover() -> None:
    small = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
    large = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=256)
    decode = GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1,
                        packed_capacity=4)
    costs = CostTable(mean_ns={small: 1_000_000, large: 2_000_000, decode: 100_000},
                      source="test")
    # 300 tokens: five 64-chunks (5 ms) or two 256-chunks (4 ms); decode never counts.
    assert pure_prefill_ms(300, (small, large, decode), costs) == pytest.approx(4.0)
    assert pure_prefill_ms(64, (small, large, decode), costs) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no prefill shape"):
        pure_prefill_ms(64, (decode,), costs)


def _run(label: str, policy: str, *, long_ttft_s: float | None, chat_itl_p99_s: float,
         long_sent: int = 2) -> dict[str, Any]:
    per_client: dict[str, Any] = {
        "default": {"requests": 10, "ttft_s": {"max": 0.1},
                    "itl_s": {"p99": chat_itl_p99_s}}}
    if long_ttft_s is not None:
        per_client["long"] = {"requests": 2, "ttft_s": {"max": long_ttft_s},
                              "itl_s": {"p99": None}}
    return {"configuration": label, "policy": policy, "rate": 4.0, "per_client": per_client,
            "sent_by_client": {"default": 10, "long": long_sent}}


def test_verdicts_against_prefill_time_and_the_best_sarathi_itl() -> None:
    runs = [_run("sarathi-256", "sarathi", long_ttft_s=0.5, chat_itl_p99_s=0.010),
            _run("sarathi-1024", "sarathi", long_ttft_s=0.3, chat_itl_p99_s=0.020),
            _run("good", "first-token", long_ttft_s=0.39, chat_itl_p99_s=0.0105),
            _run("slow-long", "balanced", long_ttft_s=0.41, chat_itl_p99_s=0.010),
            _run("jerky", "fcfs", long_ttft_s=0.2, chat_itl_p99_s=0.0115),
            _run("unfinished", "balanced", long_ttft_s=0.2, chat_itl_p99_s=0.010,
                 long_sent=3)]
    rows = {r["configuration"]: r for r in long_prompt_rows(runs, prefill_ms=100.0)}
    assert rows["good"]["ttft_over_prefill"] == pytest.approx(3.9)
    assert rows["good"]["itl_over_best_sarathi"] == pytest.approx(1.05)
    assert rows["good"]["passes"] and rows["sarathi-256"]["itl_over_best_sarathi"] == 1.0
    assert not rows["sarathi-256"]["passes"]  # 5x its prefill time
    assert not rows["slow-long"]["passes"]
    assert not rows["jerky"]["passes"]
    assert not rows["unfinished"]["passes"]  # a long prompt never got its first token
    table = long_prompt_table(list(rows.values()), 100.0)
    assert "| good | 390 | 3.90x | 10.5 | 1.05x | yes |" in table


def test_chat_itl_without_long_prompts_and_against_fixed_depth_speculation() -> None:
    runs = [_run("sarathi-256", "sarathi", long_ttft_s=0.3, chat_itl_p99_s=0.009),
            _run("fixed-spec-1", "fixed-spec-1", long_ttft_s=0.3, chat_itl_p99_s=0.020),
            _run("fixed-spec-2", "fixed-spec-2", long_ttft_s=0.3, chat_itl_p99_s=0.016),
            _run("balanced+spec", "spec-adaptive", long_ttft_s=0.3, chat_itl_p99_s=0.012)]
    alone = {"balanced+spec": _run("balanced+spec", "spec-adaptive", long_ttft_s=None,
                                   chat_itl_p99_s=0.0096)}
    rows = {r["configuration"]: r
            for r in long_prompt_rows(runs, prefill_ms=100.0, alone=alone)}
    spec = rows["balanced+spec"]
    assert spec["chat_itl_p99_alone_ms"] == pytest.approx(9.6)
    assert spec["itl_over_alone"] == pytest.approx(1.25)
    assert spec["itl_over_best_fixed_spec"] == pytest.approx(0.75)  # 12 against 16 ms
    assert not spec["passes"]  # the verdict stays against sarathi's 9 ms
    # a configuration that does not speculate has no fixed-spec ratio; no quiet run, no ratio
    assert rows["sarathi-256"]["itl_over_best_fixed_spec"] is None
    assert rows["sarathi-256"]["itl_over_alone"] is None
    table = long_prompt_table(list(rows.values()), 100.0)
    assert "| balanced+spec | 300 | 3.00x | 12.0 | 1.33x | no | 9.6 | 1.25x | 0.75x |" in table


def _record(times: tuple[float, ...], tokens: tuple[float, ...]) -> RequestRecord:
    return RequestRecord(index=0, client="default", scheduled_s=0.0, sent_s=0.0,
                         status="ok", target_prompt_tokens=8, target_output_tokens=8,
                         prompt_tokens=8, chunk_times_s=times, chunk_tokens=tokens,
                         finished_s=times[-1])


def test_a_chunk_of_n_tokens_after_gap_g_counts_as_n_intervals_of_g_over_n() -> None:
    # the first chunk opens the stream; then 30 ms delivering 3 tokens, 10 ms delivering 1
    rec = _record((0.1, 0.13, 0.14), (1.0, 3.0, 1.0))
    assert per_token_gaps_s([rec]) == pytest.approx([0.01, 0.01, 0.01, 0.01])
    assert rec.chunk_gaps_s() == pytest.approx((0.03, 0.01))
    # one-token chunks: the per-token gaps are the per-chunk gaps, so the p99s coincide
    plain = _record((0.1, 0.11, 0.13, 0.16), (1.0, 1.0, 1.0, 1.0))
    assert per_token_gaps_s([plain]) == pytest.approx(list(plain.chunk_gaps_s()))
    latency = per_client_latency([plain, rec])["default"]
    assert latency["itl_token_s"]["count"] == 7 and latency["itl_s"]["count"] == 5
    assert per_client_latency([plain])["default"]["itl_token_s"] == \
        per_client_latency([plain])["default"]["itl_s"]
    # rescaled (fractional) counts of the load benchmark give no per-token gaps
    assert per_token_gaps_s([_record((0.1, 0.13), (1.0, 2.5))]) == []


def test_per_token_column_against_the_best_sarathi_per_token_figure() -> None:
    runs = [_run("sarathi-256", "sarathi", long_ttft_s=0.3, chat_itl_p99_s=0.009),
            _run("first-token+spec", "spec-adaptive", long_ttft_s=0.3,
                 chat_itl_p99_s=0.012)]
    runs[0]["per_client"]["default"]["itl_token_s"] = {"p99": 0.009}
    runs[1]["per_client"]["default"]["itl_token_s"] = {"p99": 0.0045}
    rows = {r["configuration"]: r for r in long_prompt_rows(runs, prefill_ms=100.0)}
    spec = rows["first-token+spec"]
    assert spec["chat_itl_token_p99_ms"] == pytest.approx(4.5)
    assert spec["itl_token_over_best_sarathi"] == pytest.approx(0.5)
    assert spec["itl_over_best_sarathi"] == pytest.approx(12 / 9)  # per chunk unchanged
    table = long_prompt_table(list(rows.values()), 100.0)
    assert "| first-token+spec | 300 | 3.00x | 12.0 | 1.33x | no | - | - | - | 4.5 | 0.50x |" \
        in table
