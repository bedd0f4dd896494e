"""The two loads ``flare bench peer`` sends to each server, and how pairs are summarised.

``closed_loop_completions``: ``streams`` workers each send non-streaming greedy completions
back to back until ``requests`` have been answered; the figure is output tokens (the
``usage.completion_tokens`` the server reports) per second of wall time from the first
send to the last answer. ``streaming_load``: the load benchmark's client
(``ops.loadgen.client.run_load``) at fixed concurrency, for TTFT and ITL.
``pair_ratios`` turns per-pair figures into (min, median, max) of their ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import trio

from ops.loadgen.client import Target, discover_model, run_load
from ops.loadgen.metrics import MetricOptions, summarize
from ops.loadgen.prompts import PromptBuilder
from ops.loadgen.workload import ClientSpec, LengthSpec, plan_requests


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadShape:
    streams: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    ignore_eos: bool = False
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputResult:
    tokens_per_s: float
    completion_tokens: int
    answered: int
    errors: int
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s, "completion_tokens": self.completion_tokens,
                "answered": self.answered, "errors": self.errors, "wall_s": self.wall_s}


def completion_body(model: str, prompt: str, shape: LoadShape, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": shape.output_tokens,
                            "temperature": 0.0, "stream": stream}
    if shape.ignore_eos:
        body["ignore_eos"] = True
    return body


def fixed_prompts(builder: PromptBuilder, shape: LoadShape) -> list[str]:
    """One prompt of ``prompt_tokens`` tokens per request, the same for every server."""
    return [builder.build(shape.prompt_tokens, np.random.default_rng([shape.seed, i]))
            for i in range(shape.requests)]


async def closed_loop_completions(base_url: str, prompts: Sequence[str], shape: LoadShape, *,
                                  timeout_s: float,
                                  transport: httpx.AsyncBaseTransport | None = None
                                  ) -> ThroughputResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits,
                                 transport=transport) as http:
        model = await discover_model(http)
        next_index = 0
        tokens = answered = errors = 0

        async def worker() -> None:
            nonlocal next_index, tokens, answered, errors
            while next_index < len(prompts):
                prompt = prompts[next_index]
                next_index += 1
                try:
                    response = await http.post("/v1/completions", json=completion_body(
                        model, prompt, shape, stream=False))
                    usage = response.json().get("usage") if response.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    usage = None
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    tokens += usage["completion_tokens"]
                    answered += 1
                else:
                    errors += 1

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(min(shape.streams, len(prompts))):
                nursery.start_soon(worker)
        wall = trio.current_time() - started
    return ThroughputResult(tokens_per_s=tokens / wall if wall > 0 else 0.0,
                            completion_tokens=tokens, answered=answered, errors=errors,
                            wall_s=wall)


async def streaming_load(base_url: str, builder: PromptBuilder, shape: LoadShape, *,
                         timeout_s: float, transport: httpx.AsyncBaseTransport | None = None
                         ) -> dict[str, Any]:
    """The load benchmark's summary of one fixed-concurrency streaming run."""
    plans = plan_requests(count=shape.requests, rate=float("inf"), arrivals="poisson",
                          lengths=LengthSpec(kind="fixed", prompt_tokens=shape.prompt_tokens,
                                             output_tokens=shape.output_tokens),
                          clients=(ClientSpec(name="peer-bench"),), seed=shape.seed)
    target = Target(base_url=base_url, endpoint="completions", request_timeout_s=timeout_s,
                    ignore_eos=shape.ignore_eos, temperature=0.0)
    result = await run_load(target, plans, builder, time_limit_s=timeout_s,
                            concurrency=shape.streams, seed=shape.seed, transport=transport)
    return summarize(result.records, duration_s=result.duration_s, planned=result.planned,
                     options=MetricOptions())


def pair_ratios(ours: Sequence[float], theirs: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max) of ``ours[i] / theirs[i]`` over the pairs whose peer figure is
    positive; NaNs when there is none."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]
    if not ratios:
        nan = float("nan")
        return nan, nan, nan
    return min(ratios), statistics.median(ratios), max(ratios)
