"""The load generator behind ``flare bench serve``.

``workload`` plans arrivals, lengths and client tags; ``prompts`` builds prompt text from a
local tokenizer; ``client`` sends the plan open-loop to an OpenAI-compatible endpoint and
records every streamed chunk; ``metrics`` turns records into latency, throughput, goodput,
fairness and QoE figures; ``report`` writes run files and plots.
"""

from ops.loadgen.client import RunResult, Target, run_load
from ops.loadgen.metrics import MetricOptions, jain_index, stream_qoe, summarize
from ops.loadgen.prompts import load_prompt_builder
from ops.loadgen.records import RequestRecord
from ops.loadgen.report import (
    RunFile,
    plot_latency_cdfs,
    plot_tokens_over_time,
    read_run,
    summary_table,
    write_run,
)
from ops.loadgen.workload import ClientSpec, LengthSpec, RequestPlan, parse_clients, plan_requests

__all__ = [
    "ClientSpec",
    "LengthSpec",
    "MetricOptions",
    "RequestPlan",
    "RequestRecord",
    "RunFile",
    "RunResult",
    "Target",
    "jain_index",
    "load_prompt_builder",
    "parse_clients",
    "plan_requests",
    "plot_latency_cdfs",
    "plot_tokens_over_time",
    "read_run",
    "run_load",
    "stream_qoe",
    "summarize",
    "summary_table",
    "write_run",
]
