"""The open-loop streaming client: sends planned requests to an OpenAI-compatible endpoint.

Open loop means a request is sent at its planned time whether or not earlier ones have
finished (the arrival process, not the server, sets the pace); ``concurrency`` switches to a
closed loop of that many workers, each sending its next request when the previous ends.
Either way the run stops by itself: after the last planned request finishes, or at
``time_limit_s`` after the start, when unsent requests are dropped and requests in flight
are cancelled and recorded as ``cancelled`` with what they had received.

Requests go to ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (one user
message) with ``stream: true`` and ``stream_options.include_usage``; the client tag goes in
the OpenAI ``user`` field. The SSE body is parsed line by line here (``data:`` lines,
``[DONE]`` terminator), and the arrival time of every chunk that carries output text is
recorded on trio's clock. httpx runs under trio through anyio; the connection pool is
unbounded so that pool queueing never hides server queueing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx
import numpy as np
import trio

from ops.loadgen.prompts import PromptBuilder
from ops.loadgen.records import RequestRecord, RequestStatus, rescale_chunk_tokens
from ops.loadgen.workload import RequestPlan

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
# Longest error body kept in a record: enough for a server's message, not a whole page.
ERROR_TEXT_LIMIT = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """Where and how to send: the server, route, model name and request options."""

    base_url: str
    endpoint: Endpoint = "completions"
    model: str | None = None  # None: the first id that GET /v1/models lists
    api_key: str | None = None
    request_timeout_s: float = 600.0
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """A snapshot of a run in progress (for a periodic progress line)."""

    elapsed_s: float
    planned: int
    sent: int
    finished: int
    errors: int
    output_chunks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """Every sent request's record, plus how the run went."""

    records: tuple[RequestRecord, ...]
    model: str
    planned: int
    duration_s: float
    hit_time_limit: bool


# Model name sent when none was given and the server does not list its models.
FALLBACK_MODEL = "default"


async def discover_model(http: httpx.AsyncClient) -> str:
    """The first model id from ``GET /v1/models``, or ``FALLBACK_MODEL`` if none is listed."""
    try:
        response = await http.get("/v1/models")
        if response.status_code == 200:
            models = response.json().get("data") or []
            if models and isinstance(models[0], dict) and models[0].get("id"):
                return str(models[0]["id"])
    except (httpx.HTTPError, ValueError):
        pass  # the benchmark's own requests will report what is wrong with the server
    return FALLBACK_MODEL


def build_body(target: Target, plan: RequestPlan, prompt: str) -> dict[str, Any]:
    """The JSON body for one planned request (``target.model`` must be resolved)."""
    body: dict[str, Any] = {
        "model": target.model if target.model is not None else FALLBACK_MODEL,
        "max_tokens": plan.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": plan.client,
    }
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    body.update(target.extra_body)
    return body


def chunk_text(event: dict[str, Any], endpoint: Endpoint) -> tuple[str, str | None]:
    """Output text and finish reason carried by one parsed SSE event (either may be empty)."""
    text_parts: list[str] = []
    finish: str | None = None
    choices = event.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        if endpoint == "chat":
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else None
        else:
            piece = choice.get("text")
        if isinstance(piece, str) and piece:
            text_parts.append(piece)
        if choice.get("finish_reason"):
            finish = str(choice["finish_reason"])
    return "".join(text_parts), finish


class _InFlight:
    """Mutable state of one request while its stream is open (owned by its task)."""

    def __init__(self, plan: RequestPlan, sent_s: float) -> None:
        self.plan = plan
        self.sent_s = sent_s
        self.chunk_times: list[float] = []
        self.chunk_counts: list[int] = []
        self.status: RequestStatus = "cancelled"
        self.http_status: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.finished_s: float | None = None
        self.usage_prompt: int | None = None
        self.usage_completion: int | None = None

    def record(self) -> RequestRecord:
        reported = self.usage_completion if self.status == "ok" else None
        return RequestRecord(
            index=self.plan.index,
            client=self.plan.client,
            scheduled_s=self.plan.arrival_s,
            sent_s=self.sent_s,
            status=self.status,
            target_prompt_tokens=self.plan.prompt_tokens,
            target_output_tokens=self.plan.output_tokens,
            prompt_tokens=(
                self.usage_prompt if self.usage_prompt is not None else self.plan.prompt_tokens
            ),
            chunk_times_s=tuple(self.chunk_times),
            chunk_tokens=rescale_chunk_tokens(self.chunk_counts, reported),
            finished_s=self.finished_s,
            http_status=self.http_status,
            finish_reason=self.finish_reason,
            error=self.error,
        )


class _Run:
    """One benchmark run: shared clock origin, prompts, and the in-flight table."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        target: Target,
        prompts: Sequence[str],
        counter: PromptBuilder,
        t0: float,
    ) -> None:
        self.http = http
        self.target = target
        self.prompts = prompts
        self.counter = counter
        self.t0 = t0
        self.flights: list[_InFlight] = []

    def now(self) -> float:
        return trio.current_time() - self.t0

    def progress(self, planned: int) -> Progress:
        return Progress(
            elapsed_s=self.now(),
            planned=planned,
            sent=len(self.flights),
            finished=sum(f.finished_s is not None for f in self.flights),
            errors=sum(f.status == "error" for f in self.flights),
            output_chunks=sum(len(f.chunk_times) for f in self.flights),
        )

    async def send(self, plan: RequestPlan) -> None:
        flight = _InFlight(plan, self.now())
        self.flights.append(flight)
        body = build_body(self.target, plan, self.prompts[plan.index])
        path = ENDPOINT_PATHS[self.target.endpoint]
        try:
            async with self.http.stream("POST", path, json=body) as response:
                flight.http_status = response.status_code
                if response.status_code != 200:
                    raw = await response.aread()
                    flight.error = raw.decode("utf-8", "replace")[:ERROR_TEXT_LIMIT]
                    flight.status = "error"
                    flight.finished_s = self.now()
                    return
                await self._read_stream(response, flight)
        except httpx.HTTPError as exc:
            flight.status = "error"
            flight.error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
            flight.finished_s = self.now()

    async def _read_stream(self, response: httpx.Response, flight: _InFlight) -> None:
        # Read to the end of the body even after [DONE]: leaving httpx's line iterator
        # half-consumed leaks its inner async generators (a ResourceWarning under trio).
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # comments, event names, ids, blank separators
            payload = line[5:].strip()
            if payload == "[DONE]":
                continue
            try:
                event = json.loads(payload)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                flight.error = flight.error or f"malformed SSE data: {payload[:100]!r}"
                continue
            if "error" in event and not event.get("choices"):
                # A failure after the stream began (OpenAI style); the body still ends.
                flight.error = flight.error or json.dumps(event["error"])[:ERROR_TEXT_LIMIT]
                continue
            text, finish = chunk_text(event, self.target.endpoint)
            if text:
                flight.chunk_times.append(self.now())
                flight.chunk_counts.append(self.counter.count_tokens(text))
            if finish:
                flight.finish_reason = finish
            usage = event.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("prompt_tokens"), int):
                    flight.usage_prompt = usage["prompt_tokens"]
                if isinstance(usage.get("completion_tokens"), int):
                    flight.usage_completion = usage["completion_tokens"]
        flight.status = "error" if flight.error is not None else "ok"
        flight.finished_s = self.now()


def build_prompts(
    plans: Sequence[RequestPlan], builder: PromptBuilder, seed: int
) -> tuple[str, ...]:
    """Prompt text for every plan (indexed by ``plan.index``), deterministic for ``seed``."""
    ordered = sorted(plans, key=lambda p: p.index)
    if [p.index for p in ordered] != list(range(len(ordered))):
        raise ValueError("plan indexes must be 0..n-1")
    return tuple(
        builder.build(p.prompt_tokens, np.random.default_rng([seed, p.index])) for p in ordered
    )


async def run_load(
    target: Target,
    plans: Sequence[RequestPlan],
    builder: PromptBuilder,
    *,
    time_limit_s: float,
    concurrency: int | None = None,
    seed: int = 0,
    transport: httpx.AsyncBaseTransport | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 10.0,
) -> RunResult:
    """Send ``plans`` to ``target`` (open loop by ``arrival_s``, or ``concurrency`` workers).

    Returns when every request has ended or ``time_limit_s`` has passed, whichever is first.
    ``on_progress`` (if given) gets a snapshot every ``progress_interval_s`` seconds.
    """
    if not time_limit_s > 0 or math.isnan(time_limit_s):
        raise ValueError("time_limit_s must be positive")
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    prompts = build_prompts(plans, builder, seed)  # before the clock starts
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=target.base_url,
        headers=headers,
        timeout=httpx.Timeout(target.request_timeout_s),
        limits=limits,
        transport=transport,
    ) as http:
        if target.model is None:
            target = replace(target, model=await discover_model(http))
        run = _Run(http, target, prompts, builder, trio.current_time())
        with trio.move_on_at(run.t0 + time_limit_s) as deadline:
            async with trio.open_nursery() as reporting:
                if on_progress is not None:
                    reporting.start_soon(
                        _report_progress, run, len(plans), on_progress, progress_interval_s
                    )
                async with trio.open_nursery() as nursery:
                    if concurrency is None:
                        for plan in sorted(plans, key=lambda p: (p.arrival_s, p.index)):
                            await trio.sleep_until(run.t0 + plan.arrival_s)
                            nursery.start_soon(run.send, plan)
                    else:
                        queue = iter(sorted(plans, key=lambda p: p.index))
                        for _ in range(min(concurrency, len(plans))):
                            nursery.start_soon(_worker, run, queue)
                reporting.cancel_scope.cancel()  # every request has ended
        duration = run.now()
    return RunResult(
        records=tuple(sorted((f.record() for f in run.flights), key=lambda r: r.index)),
        model=target.model or FALLBACK_MODEL,
        planned=len(plans),
        duration_s=duration,
        hit_time_limit=deadline.cancelled_caught,
    )


async def _report_progress(
    run: _Run, planned: int, on_progress: Callable[[Progress], None], interval_s: float
) -> None:
    """Hand a snapshot to ``on_progress`` every ``interval_s`` until cancelled."""
    while True:
        await trio.sleep(interval_s)  # pacing a report, not synchronising with anything
        on_progress(run.progress(planned))


async def _worker(run: _Run, queue: Iterator[RequestPlan]) -> None:
    """Closed-loop worker: the next plan as soon as the previous request ends."""
    for plan in queue:
        await run.send(plan)
