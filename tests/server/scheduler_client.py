"""Client side of the HTTP scheduler tests: streaming completions with arrival times,
metric scrapes, and the printed report (VER-33). SSE arrival gaps are client-side
delivery gaps, never device execution times or per-token latencies (VER-34)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from actors.config import RuntimeConfig
from actors.public import Runtime

OpenRuntime = Callable[[RuntimeConfig], AbstractAsyncContextManager[Runtime]]

COUNTER_FAMILIES = ("flare_scheduler_executions", "flare_scheduler_graph_executions")


@dataclass
class StreamResult:
    label: str
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    arrivals: list[float] = field(default_factory=list)
    sent_at: float = 0.0
    error: str | None = None
    done: bool = False

    @property
    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def first_arrival_ms(self) -> float | None:
        return (self.arrivals[0] - self.sent_at) * 1000 if self.arrivals else None


async def stream_completion(client: httpx.AsyncClient, label: str, prompt: str | list[int],
                            max_tokens: int, *, chunks_seen: trio.Event | None = None,
                            notify_after: int = 0) -> StreamResult:
    """Greedy, EOS ignored so the output length is exactly ``max_tokens``."""
    result = StreamResult(label=label, sent_at=time.monotonic())
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            result.error = f"HTTP {response.status_code}: {response.text}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                result.done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                continue
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    result.arrivals.append(time.monotonic())
                    result.text += choice["text"]
                if choice.get("logprobs"):
                    result.tokens.extend(choice["logprobs"]["tokens"])
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            if chunks_seen is not None and len(result.arrivals) >= notify_after:
                chunks_seen.set()
    return result


async def cancel_after_chunks(host: str, port: int, label: str, prompt: str | list[int],
                              max_tokens: int, chunks: int) -> StreamResult:
    """Start a stream over a bare socket and disconnect after ``chunks`` data events."""
    result = StreamResult(label=label, sent_at=time.monotonic())
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                               f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                               "\r\n\r\n").encode() + body)
        data = b""
        while data.count(b"data: ") < chunks:
            more = await stream.receive_some(65536)
            if not more:
                result.error = "connection closed early"
                break
            data += more
            result.arrivals.append(time.monotonic())
    return result


async def scrape_counters(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)
            if k.startswith(COUNTER_FAMILIES) and after[k] != before.get(k, 0.0)}


def report(title: str, results: list[StreamResult], deltas: dict[str, float]) -> str:
    lines = [f"== {title}"]
    for r in results:
        usage = r.usage or {}
        gaps = r.gaps_ms
        gap_text = (f"gaps n={len(gaps)} median={statistics.median(gaps):.1f}ms "
                    f"max={max(gaps):.1f}ms" if gaps else "gaps n=0")
        first = r.first_arrival_ms
        lines.append(f"  {r.label}: prompt_tokens={usage.get('prompt_tokens')} "
                     f"output_tokens={usage.get('completion_tokens')} "
                     f"first_sse={'-' if first is None else f'{first:.1f}ms'} {gap_text} "
                     f"finish={r.finish_reason} error={r.error}")
    lines.append("  graph-counter deltas: " + (", ".join(
        f"{k}=+{v:g}" for k, v in deltas.items()) or "none"))
    text = "\n".join(lines)
    print(text)
    return text
