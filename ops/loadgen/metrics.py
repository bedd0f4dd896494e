"""Metrics over recorded streams: latency distributions, throughput, goodput, fairness, QoE.

Pure functions of ``RequestRecord`` values (no clock, no I/O), so tests check them on
synthetic streams with hand-computed answers. Definitions (``docs/load-benchmark.md``
repeats them for users):

* **TTFT**: arrival of the first chunk carrying output text minus the send time.
* **TPOT**: (last text chunk - first text chunk) / (output tokens - 1), per request with
  more than one output token.
* **ITL per chunk**: every gap between consecutive text chunks of a request, pooled.
* **ITL token-weighted**: a chunk of ``k`` tokens arriving ``g`` after the previous chunk
  gives each of its ``k`` tokens an inter-token latency of ``g / k``; the distribution is
  over tokens (mean = total gap time / tokens after the first chunk).
* **E2E**: end of the stream minus send time, per successful request.
* **Longest stall**: per successful request, its largest gap between text chunks (what a
  long prompt admitted beside it costs a streaming reader); distribution over requests.
* Distributions report mean, median, p90, p99 (numpy's linear interpolation between order
  statistics), min and max; weighted ones use the inverted empirical CDF (the smallest value
  whose cumulative weight reaches the quantile).
* **Throughput**: successful requests, output tokens (all streams, partial ones included)
  and prompt-plus-output tokens, each divided by the run's duration.
* **Goodput**: successful requests with TTFT <= the TTFT SLO and TPOT <= the TPOT SLO (an
  absent SLO, or a request without a TPOT, passes that check), per second and as a
  fraction of the requests sent.
* **Jain's fairness index** of per-client service ``x_i``: ``(sum x)^2 / (n * sum x^2)``,
  1 when all clients got equal service, ``1/n`` when one got everything. Service is
  ``input_weight * prompt tokens`` (of requests that reached their first token) plus
  ``output_weight * output tokens delivered`` (VTC's weighting, 1 and 2 by default). It is
  reported on raw service and on service divided by demand (the same weighting of what
  each client asked for), since clients with unequal demand should not get equal service.
* **Streaming QoE** (see ``stream_qoe``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ops.loadgen.records import RequestRecord

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricOptions:
    """SLOs, QoE reading model and fairness weights for one summary."""

    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    qoe_expected_ttft_s: float = 1.0
    qoe_reading_tokens_per_s: float = 10.0
    service_input_weight: float = 1.0
    service_output_weight: float = 2.0


def distribution(values: Iterable[float] | FloatArray) -> dict[str, float | int | None]:
    """Count, mean, median, p90, p99, min, max (``None`` statistics when empty)."""
    data = (values.astype(float, copy=False) if isinstance(values, np.ndarray)
            else np.asarray(list(values), dtype=float))
    if data.size == 0:
        return {
            "count": 0,
            "mean": None,
            "median": None,
            "p90": None,
            "p99": None,
            "min": None,
            "max": None,
        }
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return {
        "count": int(data.size),
        "mean": float(data.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(data.min()),
        "max": float(data.max()),
    }


def _weighted_quantiles(values: FloatArray, weights: FloatArray,
                        qs: Sequence[float]) -> list[float]:
    """``weighted_quantile`` for several ``qs`` from one sort."""
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be in [0, 1]")
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    if v.size == 0 or w.sum() <= 0:
        raise ValueError("need at least one positive weight")
    cumulative = np.cumsum(w)
    # A small tolerance so that float rounding in the cumulative sum never skips a value.
    targets = np.asarray(qs, dtype=float) * cumulative[-1] * (1 - 1e-12)
    return [float(x) for x in v[np.searchsorted(cumulative, targets, side="left")]]


def weighted_quantile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """Smallest value whose cumulative weight reaches ``q`` of the total (inverted CDF)."""
    return _weighted_quantiles(np.asarray(values, dtype=float),
                               np.asarray(weights, dtype=float), [q])[0]


def weighted_distribution(
    values: Sequence[float] | FloatArray, weights: Sequence[float] | FloatArray
) -> dict[str, float | int | None]:
    """Like ``distribution`` but each value counts with its weight (``count`` = total weight)."""
    vals = np.asarray(values, dtype=float)
    wts = np.asarray(weights, dtype=float)
    if vals.shape != wts.shape:
        raise ValueError("values and weights differ in length")
    keep = wts > 0
    vals, wts = vals[keep], wts[keep]
    if not vals.size:
        return distribution(())
    total = float(wts.sum())
    median, p90, p99 = _weighted_quantiles(vals, wts, (0.5, 0.9, 0.99))
    return {
        "count": total,
        "mean": float(np.dot(vals, wts) / total),
        "median": median,
        "p90": p90,
        "p99": p99,
        "min": float(vals.min()),
        "max": float(vals.max()),
    }


def _chunk_arrays(records: Iterable[RequestRecord]
                  ) -> list[tuple[FloatArray, FloatArray]]:
    """Per record: (gaps between text chunks, tokens of every chunk after the first)."""
    out = []
    for r in records:
        times = np.asarray(r.chunk_times_s, dtype=float)
        out.append((np.diff(times), np.asarray(r.chunk_tokens[1:], dtype=float)))
    return out


def _token_weighted(arrays: Sequence[tuple[FloatArray, FloatArray]]
                    ) -> tuple[FloatArray, FloatArray]:
    if not arrays:
        return np.zeros(0), np.zeros(0)
    gaps = np.concatenate([g for g, _ in arrays])
    tokens = np.concatenate([k for _, k in arrays])
    keep = tokens > 0
    return gaps[keep] / tokens[keep], tokens[keep]


def token_weighted_itl(records: Iterable[RequestRecord]) -> tuple[list[float], list[float]]:
    """(per-token latency ``g / k``, weight ``k``) for every chunk after a request's first."""
    values, weights = _token_weighted(_chunk_arrays(records))
    return values.tolist(), weights.tolist()


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n sum x^2)``; 1.0 for no clients or all zeros."""
    x = np.asarray(values, dtype=float)
    if x.size == 0 or not np.any(x):
        return 1.0
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))


def _area_min(d: FloatArray, e_a: FloatArray, e_b: FloatArray,
              width: FloatArray) -> FloatArray:
    """Per interval: the integral of ``min(d, E)`` where E rises linearly from e_a to e_b."""
    rising = e_b - e_a
    safe = np.where(rising > 0, rising, 1.0)
    cross = np.clip((d - e_a) / safe, 0.0, 1.0) * width
    crossing = (e_a + d) / 2 * cross + d * (width - cross)
    return np.where(e_b <= d, (e_a + e_b) / 2 * width,
                    np.where(e_a >= d, d * width, crossing))


def stream_qoe(
    record: RequestRecord, expected_ttft_s: float, reading_tokens_per_s: float
) -> float | None:
    """Fraction of the expected reading curve the user actually had, in [0, 1].

    With ``t`` measured from the send time, ``N`` the stream's output tokens and ``H`` the
    arrival time of its last text chunk:

    * expected tokens ``E(t) = min(N, max(0, reading_tokens_per_s * (t - expected_ttft_s)))``
      (a reader who wants the first token after ``expected_ttft_s`` and then reads at a
      steady speed, never expecting more than the answer holds);
    * delivered tokens ``D(t)`` = tokens in chunks that arrived at or before ``t``;
    * ``QoE = integral_0^H min(D, E) dt / integral_0^H E dt``, computed exactly (both
      curves are piecewise linear between the chunk arrivals and the reader's two kinks,
      so each interval's integral is closed-form; one vectorised pass over them).

    QoE is 1 when delivery never fell behind the reader, and falls towards 0 the longer and
    further it lagged. A stream that ended before the reader expected its first token scores
    1. ``None`` for requests that did not finish or delivered no text.
    """
    if expected_ttft_s < 0 or not reading_tokens_per_s > 0:
        raise ValueError("need expected_ttft_s >= 0 and reading_tokens_per_s > 0")
    if record.status != "ok" or not record.chunk_times_s:
        return None
    total = record.output_tokens
    times = np.asarray(record.chunk_times_s, dtype=float) - record.sent_s
    horizon = float(times[-1])
    full_at = expected_ttft_s + total / reading_tokens_per_s
    kinks = [t for t in (expected_ttft_s, full_at) if t < horizon]
    points = np.unique(np.concatenate((times, [0.0, horizon], kinks)))
    points = points[(points >= 0.0) & (points <= horizon)]
    if points.size < 2:
        return 1.0
    a, b = points[:-1], points[1:]
    delivered_at = np.concatenate(([0.0], np.cumsum(record.chunk_tokens, dtype=float)))
    # Tokens delivered by the start of [a, b): chunks with arrival <= a.
    d = delivered_at[np.searchsorted(times, a, side="right")]
    e_a = np.minimum(total, np.maximum(0.0, reading_tokens_per_s * (a - expected_ttft_s)))
    e_b = np.minimum(total, np.maximum(0.0, reading_tokens_per_s * (b - expected_ttft_s)))
    width = b - a
    wanted = float(np.sum((e_a + e_b) / 2 * width))
    if wanted <= 0:
        return 1.0
    had = float(np.sum(_area_min(d, e_a, e_b, width)))
    return min(1.0, had / wanted)


def _is_good(r: RequestRecord, options: MetricOptions) -> bool:
    if r.status != "ok" or r.ttft_s is None:
        return False
    if options.ttft_slo_s is not None and r.ttft_s > options.ttft_slo_s:
        return False
    tpot = r.tpot_s
    return not (options.tpot_slo_s is not None and tpot is not None and tpot > options.tpot_slo_s)


def client_service(
    records: Sequence[RequestRecord], options: MetricOptions
) -> dict[str, dict[str, float]]:
    """Per client: requests sent, weighted service received, weighted demand, and their ratio."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        row = out.setdefault(
            r.client, {"requests": 0.0, "output_tokens": 0.0, "service": 0.0, "demand": 0.0}
        )
        row["requests"] += 1
        row["output_tokens"] += r.output_tokens
        served_prompt = r.prompt_tokens if r.chunk_times_s else 0
        row["service"] += (
            options.service_input_weight * served_prompt
            + options.service_output_weight * r.output_tokens
        )
        row["demand"] += (
            options.service_input_weight * r.target_prompt_tokens
            + options.service_output_weight * r.target_output_tokens
        )
    for row in out.values():
        row["service_per_demand"] = row["service"] / row["demand"] if row["demand"] else 0.0
    return out


def _per_client_latency(
    records: Sequence[RequestRecord], qoe: Sequence[float | None]
) -> dict[str, dict[str, Any]]:
    """Per client: TTFT, E2E and QoE distributions over its successful requests
    (``qoe[i]`` is ``records[i]``'s stream QoE)."""
    by_client: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        if r.status == "ok":
            by_client.setdefault(r.client, []).append(i)
    out: dict[str, dict[str, Any]] = {}
    for client in sorted({r.client for r in records}):
        ok = by_client.get(client, [])
        out[client] = {
            "ttft_s": distribution(t for i in ok if (t := records[i].ttft_s) is not None),
            "e2e_s": distribution(t for i in ok if (t := records[i].e2e_s) is not None),
            "qoe": distribution(q for i in ok if (q := qoe[i]) is not None),
        }
    return out


def summarize(
    records: Sequence[RequestRecord], *, duration_s: float, planned: int, options: MetricOptions
) -> dict[str, Any]:
    """Every metric of one run, as a JSON-ready dict."""
    ok = [r for r in records if r.status == "ok"]
    per_second = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    output_tokens = sum(r.output_tokens for r in records)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    chunks = _chunk_arrays(ok)
    gaps = np.concatenate([g for g, _ in chunks]) if chunks else np.zeros(0)
    itl_values, itl_weights = _token_weighted(chunks)
    good = [r for r in records if _is_good(r, options)]
    clients = client_service(records, options)
    qoe_each = [
        stream_qoe(r, options.qoe_expected_ttft_s, options.qoe_reading_tokens_per_s)
        for r in records
    ]
    qoe_values = [q for q in qoe_each if q is not None]
    qoe = distribution(qoe_values)
    qoe["p10"] = float(np.percentile(qoe_values, 10)) if qoe_values else None
    return {
        "requests": {
            "planned": planned,
            "sent": len(records),
            "ok": len(ok),
            "error": sum(r.status == "error" for r in records),
            "cancelled": sum(r.status == "cancelled" for r in records),
        },
        "duration_s": duration_s,
        "throughput": {
            "requests_per_s": per_second(len(ok)),
            "output_tokens_per_s": per_second(output_tokens),
            "total_tokens_per_s": per_second(output_tokens + prompt_tokens),
        },
        "ttft_s": distribution(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_s": distribution(t for r in ok if (t := r.tpot_s) is not None),
        "itl_s": distribution(gaps),
        "itl_token_weighted_s": weighted_distribution(itl_values, itl_weights),
        "e2e_s": distribution(e for r in ok if (e := r.e2e_s) is not None),
        "longest_stall_s": distribution(float(g.max()) for g, _ in chunks if g.size),
        "per_client": _per_client_latency(records, qoe_each),
        "goodput": {
            "ttft_slo_s": options.ttft_slo_s,
            "tpot_slo_s": options.tpot_slo_s,
            "good_requests": len(good),
            "fraction_of_sent": len(good) / len(records) if records else 0.0,
            "requests_per_s": per_second(len(good)),
            "output_tokens_per_s": per_second(sum(r.output_tokens for r in good)),
        },
        "fairness": {
            "input_weight": options.service_input_weight,
            "output_weight": options.service_output_weight,
            "jain_service": jain_index([c["service"] for c in clients.values()]),
            "jain_service_per_demand": jain_index(
                [c["service_per_demand"] for c in clients.values()]
            ),
            "clients": clients,
        },
        "qoe": {
            "expected_ttft_s": options.qoe_expected_ttft_s,
            "reading_tokens_per_s": options.qoe_reading_tokens_per_s,
            **qoe,
        },
    }
