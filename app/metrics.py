"""Prometheus metrics for ``GET /metrics``, named ``flare_*`` after vLLM's conventions:
runtime figures read at scrape time plus request figures the HTTP layer measures
itself. Every ``flare_*`` series carries ``model_name`` (the served name); the
process's own ``process_*`` series come from ``prometheus_client``'s
``ProcessCollector``; no ``_created`` series are exposed. The reference, with what
each series means and where its data comes from, is ``docs/logging.md`` (*Metrics*).

Runtime side (a custom collector calling ``Runtime.statistics()`` once per scrape; seed:
Funded acceptance learning, last paragraph, counts executions by kind):
``flare_scheduler_execution_nanoseconds_total{kind}``, ``flare_scheduler_executions_total{kind}``,
``flare_scheduler_graph_executions_total{graph}``, ``flare_requests_running``,
``flare_requests_waiting``, ``flare_kv_pages_used`` (in use by requests),
``flare_kv_pages_cached`` (held by the prefix cache alone), ``flare_kv_pages_total``,
``flare_kv_cache_usage_perc`` (used / total, 0..1), ``flare_prefix_cache_queries_total``
and ``flare_prefix_cache_hits_total`` (tokens; ``flare_prefix_cache_hit_tokens_total`` is
the older name of the hits), ``flare_num_preemptions_total`` (always 0: flare never
preempts), ``flare_scheduler_prompt_tokens_total``,
``flare_scheduler_generation_tokens_total``; with speculation on, by proposal source
``{source}``: ``flare_speculative_programs_total``, ``flare_speculative_drafted_tokens_total``,
``flare_speculative_accepted_tokens_total``,
``flare_speculative_accepted_by_position_total{source,position}`` and the counterfactual
rounds' ``flare_speculative_counterfactual_{rounds,drafted_tokens,accepted_tokens}_total``
(zero unless adaptive speculation observes them: replayed copy lookups, or the learned
draft's depth-one proposals for greedy requests).

HTTP side: ``flare_prompt_tokens_total``, ``flare_generation_tokens_total``,
``flare_requests_finished_total{reason}``, ``flare_http_errors_total{status}``, the
histograms ``flare_time_to_first_token_seconds``, ``flare_inter_token_latency_seconds``,
``flare_e2e_request_latency_seconds`` (client-facing times measured where the HTTP layer
receives events; they are not device execution times, VER-34), and per finished request
``flare_request_{queue,prefill,decode,inference}_time_seconds`` (the runtime clock's
phases that ``Finished`` reports), ``flare_request_prompt_tokens`` and
``flare_request_generation_tokens``.

Each app owns its own ``CollectorRegistry`` so several servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors import Finished, RuntimeStatistics

log = structlog.get_logger("flare.app.metrics")

TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
"""Time to first token: milliseconds when idle, many minutes behind a long queue."""
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                     120.0, 300.0, 600.0, 900.0, 1200.0, 1800.0)
"""Whole requests and their phases (e2e, queue, prefill, decode): up to half an hour."""


def length_buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_tokens`` (vLLM's 1-2-5 series
    bounded by the context length)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= max_tokens:
                return (*buckets, max(1, max_tokens))
            buckets.append(step * scale)
        scale *= 10


class RuntimeCollector(Collector):
    """Reads one ``RuntimeStatistics`` snapshot per scrape."""

    def __init__(self, statistics: Callable[[], RuntimeStatistics]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._statistics()
        except Exception:
            # A failing snapshot must not turn /metrics into a 500 that hides the HTTP
            # metrics too; it is logged loudly instead.
            log.exception("metrics.statistics_failed")
            return
        ns = CounterMetricFamily("flare_scheduler_execution_nanoseconds",
                                 "Measured execution time of scheduled programs, by graph kind.",
                                 labels=["kind"])
        for kind, value in stats.execution_ns_by_kind:
            ns.add_metric([kind], value)
        yield ns
        count = CounterMetricFamily("flare_scheduler_executions",
                                    "Executions of scheduled programs, by graph kind.",
                                    labels=["kind"])
        for kind, value in stats.executions_by_kind:
            count.add_metric([kind], value)
        yield count
        graphs = CounterMetricFamily("flare_scheduler_graph_executions",
                                     "Executions per prepared graph (physical shape).",
                                     labels=["graph"])
        for graph, value in stats.executions_by_graph:
            graphs.add_metric([graph], value)
        yield graphs
        usage = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
        for name, text, value in (
                ("flare_requests_running", "Requests resident in the scheduler.",
                 stats.requests_running),
                ("flare_requests_waiting", "Requests waiting for admission.",
                 stats.requests_waiting),
                ("flare_kv_pages_used", "KV cache pages in use by requests.",
                 stats.kv_pages_used),
                ("flare_kv_pages_cached",
                 "KV cache pages held by the prefix cache alone (evictable).",
                 stats.kv_pages_cached),
                ("flare_kv_pages_total", "KV cache pages in the pool.", stats.kv_pages_total),
                ("flare_kv_cache_usage_perc", "Fraction of KV cache pages in use by requests "
                 "(0..1; cached-only pages are free).", usage)):
            yield GaugeMetricFamily(name, text, value=value)
        for name, text, value in (
                ("flare_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                 stats.prefix_cache_hit_tokens),
                ("flare_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.prefix_cache_query_tokens),
                ("flare_prefix_cache_hits", "Prompt tokens the prefix cache lookups found.",
                 stats.prefix_cache_hit_tokens),
                ("flare_num_preemptions", "Resident requests preempted (always 0: a request "
                 "becomes resident only with pages for its worst case, so flare never "
                 "preempts).", stats.preemptions),
                ("flare_scheduler_prompt_tokens", "Prompt tokens processed by the runtime.",
                 stats.prompt_tokens_total),
                ("flare_scheduler_generation_tokens", "Output tokens committed by the runtime.",
                 stats.generation_tokens_total),
                ("flare_window_snapshots", "Window snapshots (each restored at once) of "
                 "requests whose images span several windows.", stats.window_snapshots),
                ("flare_admission_reordered", "Requests queued ahead of an earlier arrival "
                 "(--admission-order least-slack).", stats.admission_reordered)):
            yield CounterMetricFamily(name, text, value=value)
        if stats.speculative_source:
            yield from _speculative_metrics(stats)


def _speculative_metrics(stats: RuntimeStatistics) -> Iterator[Metric]:
    """``flare_speculative_*`` counters, labelled by proposal source."""
    source = [stats.speculative_source]
    for name, text, value in (
            ("flare_speculative_programs", "Complete speculative programs run.",
             stats.speculative_frames),
            ("flare_speculative_drafted_tokens", "Draft tokens the target verified.",
             stats.speculative_drafted_tokens),
            ("flare_speculative_accepted_tokens", "Draft tokens the target accepted.",
             stats.speculative_accepted_tokens),
            ("flare_speculative_counterfactual_rounds",
             "Counterfactual rounds decided (copy: replayed lookups on frames that "
             "verified no copy drafts; learned: depth-one proposals of width-one steps).",
             stats.counterfactual_rounds),
            ("flare_speculative_counterfactual_drafted_tokens",
             "Drafts the counterfactual rounds offered.",
             stats.counterfactual_drafted_tokens),
            ("flare_speculative_counterfactual_accepted_tokens",
             "Counterfactual drafts that equalled the following tokens.",
             stats.counterfactual_accepted_tokens)):
        family = CounterMetricFamily(name, text, labels=["source"])
        family.add_metric(source, value)
        yield family
    family = CounterMetricFamily(
        "flare_speculative_accepted_by_position",
        "Rounds whose draft at this 0-based position was accepted.",
        labels=["source", "position"])
    for position, value in enumerate(stats.speculative_accepted_by_position):
        family.add_metric([stats.speculative_source, str(position)], value)
    yield family


class _Exposition(Collector):
    """What ``/metrics`` renders: the registry's families with ``model_name`` on every
    ``flare_*`` series (the constant label the Python client has no option for) and
    without the ``_created`` samples of counters and histograms (vLLM drops them too:
    one more series per family that dashboards never use)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            if family.name.startswith("flare_"):
                samples = [s._replace(labels={"model_name": self._model_name, **s.labels})
                           for s in samples]
            family.samples = samples
            yield family


class AppMetrics:
    """The HTTP layer's own measurements, registered with the runtime collector and
    the process collector; ``model_name`` labels every flare series, ``max_model_len``
    bounds the token-count buckets."""

    def __init__(self, statistics: Callable[[], RuntimeStatistics], *,
                 model_name: str = "", max_model_len: int = 1 << 20) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(RuntimeCollector(statistics))
        ProcessCollector(registry=self.registry)
        self._exposition = CollectorRegistry(auto_describe=False)
        self._exposition.register(_Exposition(self.registry, model_name))
        self.prompt_tokens = Counter("flare_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("flare_generation_tokens",
                                         "Output tokens of finished requests.",
                                         registry=self.registry)
        self.requests_finished = Counter("flare_requests_finished",
                                         "Requests that ended, by finish reason.",
                                         ["reason"], registry=self.registry)
        self.http_errors = Counter("flare_http_errors", "Error responses, by status.", ["status"],
                                   registry=self.registry)
        self.time_to_first_token = Histogram(
            "flare_time_to_first_token_seconds",
            "From request arrival to the first visible output at the HTTP layer.",
            buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.inter_token_latency = Histogram(
            "flare_inter_token_latency_seconds",
            "Gap between output deltas divided evenly over the delta's tokens.",
            buckets=INTER_TOKEN_BUCKETS_S, registry=self.registry)
        self.e2e_latency = Histogram(
            "flare_e2e_request_latency_seconds",
            "From request arrival to its last event.",
            buckets=REQUEST_BUCKETS_S, registry=self.registry)
        phase = partial(Histogram, buckets=REQUEST_BUCKETS_S, registry=self.registry)
        self.queue_time = phase(
            "flare_request_queue_time_seconds",
            "From submission to the runtime to the first frame that served the request.")
        self.prefill_time = phase(
            "flare_request_prefill_time_seconds",
            "From the request's first frame to its first output token.")
        self.decode_time = phase(
            "flare_request_decode_time_seconds",
            "From the request's first output token to its last.")
        self.inference_time = phase(
            "flare_request_inference_time_seconds",
            "From the request's first frame to its last output token (prefill + decode).")
        lengths = partial(Histogram, buckets=length_buckets(max_model_len),
                          registry=self.registry)
        self.request_prompt_tokens = lengths(
            "flare_request_prompt_tokens", "Prompt length of finished requests, in tokens.")
        self.request_generation_tokens = lengths(
            "flare_request_generation_tokens", "Output length of finished requests, in tokens.")

    def observe_finished(self, event: Finished) -> None:
        """The per-request histograms of one request the runtime finished."""
        self.request_prompt_tokens.observe(event.prompt_tokens)
        self.request_generation_tokens.observe(event.completion_tokens)
        for histogram, value in ((self.queue_time, event.queued_s),
                                 (self.prefill_time, event.prefill_s),
                                 (self.decode_time, event.decode_s)):
            if value is not None:
                histogram.observe(value)
        if event.prefill_s is not None and event.decode_s is not None:
            self.inference_time.observe(event.prefill_s + event.decode_s)

    def render(self) -> bytes:
        return generate_latest(self._exposition)
