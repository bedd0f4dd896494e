"""Prometheus metrics for ``GET /metrics``: runtime counters read at scrape time plus
request figures the HTTP layer measures itself.

Runtime side (a custom collector calling ``Runtime.statistics()`` once per scrape; seed:
Funded acceptance learning, last paragraph, counts executions by kind):
``flare_scheduler_execution_nanoseconds_total{kind}``, ``flare_scheduler_executions_total{kind}``,
``flare_scheduler_graph_executions_total{graph}``, ``flare_requests_running``,
``flare_requests_waiting``, ``flare_kv_pages_used`` (in use by requests),
``flare_kv_pages_cached`` (held by the prefix cache alone), ``flare_kv_pages_total``,
``flare_prefix_cache_hit_tokens_total``, ``flare_scheduler_prompt_tokens_total``,
``flare_scheduler_generation_tokens_total``; with speculation on, by proposal source
``{source}``: ``flare_speculative_programs_total``, ``flare_speculative_drafted_tokens_total``,
``flare_speculative_accepted_tokens_total``,
``flare_speculative_accepted_by_position_total{source,position}`` and the counterfactual
rounds' ``flare_speculative_counterfactual_{rounds,drafted_tokens,accepted_tokens}_total``
(zero unless adaptive speculation observes them: replayed copy lookups, or the learned
draft's depth-one proposals for greedy requests).

HTTP side: ``flare_prompt_tokens_total``, ``flare_generation_tokens_total``,
``flare_requests_finished_total{reason}``, ``flare_http_errors_total{status}`` and the
histograms ``flare_time_to_first_token_seconds``, ``flare_inter_token_latency_seconds``,
``flare_e2e_request_latency_seconds``. These are client-facing times measured where the
HTTP layer receives events; they are not device execution times (VER-34).

Each app owns its own ``CollectorRegistry`` so several servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors import RuntimeStatistics

log = structlog.get_logger("flare.app.metrics")

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                 600.0)


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
        yield GaugeMetricFamily("flare_requests_running", "Requests resident in the scheduler.",
                                value=stats.requests_running)
        yield GaugeMetricFamily("flare_requests_waiting", "Requests waiting for admission.",
                                value=stats.requests_waiting)
        yield GaugeMetricFamily("flare_kv_pages_used", "KV cache pages in use by requests.",
                                value=stats.kv_pages_used)
        yield GaugeMetricFamily("flare_kv_pages_cached",
                                "KV cache pages held by the prefix cache alone (evictable).",
                                value=stats.kv_pages_cached)
        yield GaugeMetricFamily("flare_kv_pages_total", "KV cache pages in the pool.",
                                value=stats.kv_pages_total)
        yield CounterMetricFamily("flare_prefix_cache_hit_tokens",
                                  "Prompt tokens served from the prefix cache.",
                                  value=stats.prefix_cache_hit_tokens)
        yield CounterMetricFamily("flare_scheduler_prompt_tokens",
                                  "Prompt tokens processed by the runtime.",
                                  value=stats.prompt_tokens_total)
        yield CounterMetricFamily("flare_scheduler_generation_tokens",
                                  "Output tokens committed by the runtime.",
                                  value=stats.generation_tokens_total)
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


class AppMetrics:
    """The HTTP layer's own measurements, registered with the runtime collector."""

    def __init__(self, statistics: Callable[[], RuntimeStatistics]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(RuntimeCollector(statistics))
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
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.inter_token_latency = Histogram(
            "flare_inter_token_latency_seconds",
            "Gap between output deltas divided evenly over the delta's tokens.",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.e2e_latency = Histogram(
            "flare_e2e_request_latency_seconds",
            "From request arrival to its last event.",
            buckets=E2E_BUCKETS_S, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
