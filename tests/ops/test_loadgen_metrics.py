"""The load benchmark's metric code on synthetic streams with hand-computed answers.

Covers the load benchmark: TTFT, TPOT, ITL per chunk and token-weighted, E2E,
percentiles, throughput, goodput under SLOs, Jain's fairness index, streaming QoE.
"""

from __future__ import annotations

import pytest

from ops.loadgen.metrics import (
    MetricOptions,
    client_service,
    distribution,
    jain_index,
    stream_qoe,
    summarize,
    token_weighted_itl,
    weighted_distribution,
    weighted_quantile,
)
from ops.loadgen.records import RequestRecord, rescale_chunk_tokens


def stream(
    times: tuple[float, ...],
    tokens: tuple[float, ...],
    *,
    sent: float = 0.0,
    finished: float | None = None,
    client: str = "a",
    status: str = "ok",
    prompt: int = 10,
    index: int = 0,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        client=client,
        scheduled_s=sent,
        sent_s=sent,
        status=status,  # type: ignore[arg-type]
        target_prompt_tokens=prompt,
        target_output_tokens=int(sum(tokens)),
        prompt_tokens=prompt,
        chunk_times_s=times,
        chunk_tokens=tokens,
        finished_s=(times[-1] if times else sent) if finished is None else finished,
    )


EXAMPLE = stream((1.5, 1.7, 2.0, 2.6), (1, 1, 2, 1), sent=1.0, finished=2.7)


def test_per_request_latencies_by_hand() -> None:
    assert EXAMPLE.ttft_s == pytest.approx(0.5)
    assert EXAMPLE.output_tokens == 5
    # (2.6 - 1.5) / (5 - 1)
    assert EXAMPLE.tpot_s == pytest.approx(0.275)
    assert EXAMPLE.e2e_s == pytest.approx(1.7)
    assert EXAMPLE.chunk_gaps_s() == pytest.approx((0.2, 0.3, 0.6))


def test_single_token_and_unfinished_requests_have_no_tpot_or_e2e() -> None:
    one = stream((0.4,), (1,))
    assert one.tpot_s is None
    assert one.ttft_s == pytest.approx(0.4)
    cut = stream((0.1, 0.2), (1, 1), status="cancelled")
    assert cut.tpot_s is None and cut.e2e_s is None


def test_token_weighted_itl_splits_a_chunk_gap_over_its_tokens() -> None:
    values, weights = token_weighted_itl([EXAMPLE])
    assert values == pytest.approx([0.2, 0.15, 0.6])
    assert weights == [1, 2, 1]
    dist = weighted_distribution(values, weights)
    assert dist["mean"] == pytest.approx(1.1 / 4)  # total gap time over tokens after the first
    assert dist["median"] == pytest.approx(0.15)  # cumulative weights 2, 3, 4: half is 2
    assert dist["p90"] == pytest.approx(0.6)
    assert dist["count"] == 4


def test_percentiles_interpolate_linearly() -> None:
    dist = distribution([1, 2, 3, 4, 10])
    assert dist["mean"] == pytest.approx(4)
    assert dist["median"] == pytest.approx(3)
    assert dist["p90"] == pytest.approx(7.6)  # rank 3.6: 4 + 0.6 * 6
    assert dist["p99"] == pytest.approx(9.76)  # rank 3.96
    assert distribution([])["mean"] is None


def test_weighted_quantile_is_the_inverted_cdf() -> None:
    assert weighted_quantile([5, 1, 3], [1, 1, 1], 0.5) == 3
    assert weighted_quantile([5, 1, 3], [1, 1, 8], 0.05) == 1
    assert weighted_quantile([5, 1, 3], [1, 1, 8], 0.95) == 5
    assert weighted_quantile([5, 1, 3], [1, 1, 8], 0.85) == 3


def test_jain_index_known_values() -> None:
    assert jain_index([2, 2, 2, 2]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([1, 2, 3]) == pytest.approx(36 / 42)
    assert jain_index([]) == 1.0


def test_qoe_steady_lag_by_hand() -> None:
    """Reader expects token 1 at t=1 then 1 tok/s; tokens arrive at 2, 3, 4, 5.

    Expected area over [0, 5] is a triangle of 4 x 4 / 2 = 8; the user had 0 + 1 + 2 + 3 = 6.
    """
    record = stream((2, 3, 4, 5), (1, 1, 1, 1))
    assert stream_qoe(record, 1.0, 1.0) == pytest.approx(0.75)


def test_qoe_with_a_crossing_inside_an_interval() -> None:
    """T=0, 1 tok/s; 2 tokens at 0.5, 1 token at 4: E crosses D=2 at t=2.

    Expected: triangle to 3 tokens at t=3 (4.5) plus 3 x 1 = 7.5. Had: 0 on [0, .5);
    (0.5+2)/2 x 1.5 + 2 x 1 on [.5, 3); 2 on [3, 4): 5.875.
    """
    record = stream((0.5, 4.0), (2, 1))
    assert stream_qoe(record, 0.0, 1.0) == pytest.approx(5.875 / 7.5)


def test_qoe_is_capped_at_the_answer_length_and_penalises_a_late_tail() -> None:
    """4 tokens at t=2, last token at t=6; T=1, 1 tok/s, N=5: had 11.5 of 12.5."""
    record = stream((2.0, 6.0), (4, 1))
    assert stream_qoe(record, 1.0, 1.0) == pytest.approx(11.5 / 12.5)


def test_qoe_is_one_when_delivery_keeps_ahead_and_zero_when_all_comes_at_the_end() -> None:
    assert stream_qoe(stream((0.1, 0.2), (1, 1)), 1.0, 1.0) == 1.0  # done before expected
    assert stream_qoe(stream((0.5, 1.0, 1.5), (1, 1, 1)), 0.5, 1.0) == 1.0  # ahead of reader
    # Nothing until 1.0 while the reader wanted up to half a token: had 0.375 of 0.5.
    assert stream_qoe(stream((1.0, 1.5), (1, 1)), 0.5, 1.0) == pytest.approx(0.75)
    assert stream_qoe(stream((3.0,), (4,)), 1.0, 1.0) == 0.0
    # Sent at 10: times are measured from the send time.
    assert stream_qoe(stream((12, 13, 14, 15), (1, 1, 1, 1), sent=10), 1.0, 1.0) == (
        pytest.approx(0.75)
    )
    assert stream_qoe(stream((), ()), 1.0, 1.0) is None


def test_goodput_counts_requests_within_both_slos() -> None:
    records = [
        stream((0.5, 1.0, 1.5), (1, 1, 1), index=0),  # ttft .5, tpot .5: too slow per token
        stream((0.5, 0.6, 0.7), (1, 1, 1), index=1),  # ttft .5, tpot .1: good
        stream((2.0, 2.1), (1, 1), index=2),  # ttft 2: too slow to start
        stream((0.3,), (1,), index=3),  # single token, no TPOT: good
        stream((0.1, 0.2), (1, 1), status="cancelled", index=4),  # unfinished: never good
    ]
    summary = summarize(
        records, duration_s=4.0, planned=6, options=MetricOptions(ttft_slo_s=1.0, tpot_slo_s=0.2)
    )
    assert summary["goodput"]["good_requests"] == 2
    assert summary["goodput"]["fraction_of_sent"] == pytest.approx(2 / 5)
    assert summary["goodput"]["requests_per_s"] == pytest.approx(0.5)
    assert summary["goodput"]["output_tokens_per_s"] == pytest.approx(4 / 4.0)
    assert summary["requests"] == {"planned": 6, "sent": 5, "ok": 4, "error": 0, "cancelled": 1}
    # Output tokens count partial streams too: 3 + 3 + 2 + 1 + 2 = 11 over 4 s.
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(11 / 4)
    assert summary["throughput"]["requests_per_s"] == pytest.approx(1.0)
    # Prompt tokens of the 4 ok requests (10 each) plus all output.
    assert summary["throughput"]["total_tokens_per_s"] == pytest.approx((40 + 11) / 4)
    assert summary["ttft_s"]["count"] == 4
    assert summary["tpot_s"]["count"] == 3


def test_no_slo_means_every_finished_request_is_good() -> None:
    records = [stream((5.0, 9.0), (1, 1)), stream((0.1,), (1,), status="error")]
    summary = summarize(records, duration_s=10.0, planned=2, options=MetricOptions())
    assert summary["goodput"]["good_requests"] == 1


def test_client_service_and_fairness_by_hand() -> None:
    """a: two requests of (10 in, 3 out); b: one (10 in, 3 out) and one that never started."""
    records = [
        stream((1, 2, 3), (1, 1, 1), client="a", index=0),
        stream((1, 2, 3), (1, 1, 1), client="a", index=1),
        stream((1, 2, 3), (1, 1, 1), client="b", index=2),
        stream((), (), client="b", status="cancelled", index=3, prompt=10),
    ]
    options = MetricOptions(service_input_weight=1.0, service_output_weight=2.0)
    clients = client_service(records, options)
    assert clients["a"]["service"] == pytest.approx(2 * (10 + 2 * 3))
    # b's unstarted request gets no prompt service; its demand still counts (target 0 out).
    assert clients["b"]["service"] == pytest.approx(16)
    assert clients["b"]["demand"] == pytest.approx(16 + 10)
    summary = summarize(records, duration_s=3.0, planned=4, options=options)
    assert summary["fairness"]["jain_service"] == pytest.approx(
        (32 + 16) ** 2 / (2 * (32**2 + 16**2))
    )
    ratios = (1.0, 16 / 26)
    assert summary["fairness"]["jain_service_per_demand"] == pytest.approx(
        sum(ratios) ** 2 / (2 * sum(r * r for r in ratios))
    )


def test_summary_latency_sections_match_the_records() -> None:
    summary = summarize(
        [EXAMPLE],
        duration_s=2.0,
        planned=1,
        options=MetricOptions(qoe_expected_ttft_s=0.0, qoe_reading_tokens_per_s=1000.0),
    )
    assert summary["ttft_s"]["mean"] == pytest.approx(0.5)
    assert summary["e2e_s"]["median"] == pytest.approx(1.7)
    assert summary["itl_s"]["max"] == pytest.approx(0.6)
    assert summary["itl_token_weighted_s"]["mean"] == pytest.approx(0.275)
    # A very fast reader wants all 5 tokens 5 ms after sending; over the 1.6 s to the last
    # chunk the user had 1 x .2 + 2 x .3 + 4 x .6 = 3.2 of 5 x 1.6 - 5 x .005 / 2.
    assert summary["qoe"]["mean"] == pytest.approx(3.2 / (8 - 0.0125))


def test_longest_stall_and_per_client_latency() -> None:
    records = [
        EXAMPLE,  # client a, gaps .2 .3 .6, TTFT .5
        stream((0.1, 0.2, 1.2), (1, 1, 1), client="b", index=1),  # gaps .1 1.0, TTFT .1
        stream((0.3,), (1,), client="b", index=2),  # no gaps: no stall sample
    ]
    summary = summarize(records, duration_s=3.0, planned=3, options=MetricOptions())
    assert summary["longest_stall_s"]["count"] == 2
    assert summary["longest_stall_s"]["max"] == pytest.approx(1.0)
    assert summary["longest_stall_s"]["min"] == pytest.approx(0.6)
    per_client = summary["per_client"]
    assert per_client["a"]["ttft_s"]["mean"] == pytest.approx(0.5)
    assert per_client["b"]["ttft_s"]["mean"] == pytest.approx(0.2)
    assert per_client["b"]["e2e_s"]["max"] == pytest.approx(1.2)
    assert per_client["b"]["qoe"]["count"] == 2


def test_chunk_tokens_rescale_to_the_reported_usage() -> None:
    assert rescale_chunk_tokens([1, 1, 2], 8) == pytest.approx((2, 2, 4))
    assert rescale_chunk_tokens([0, 1], None) == (1.0, 1.0)  # text-bearing chunks count
    assert rescale_chunk_tokens([1, 1], 0) == (1.0, 1.0)  # a zero report is ignored


def test_record_round_trips_through_json() -> None:
    assert RequestRecord.from_json(EXAMPLE.to_json()) == EXAMPLE
