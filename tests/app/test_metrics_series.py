"""``GET /metrics`` after vLLM's conventions, on the real runtime and the embedded
model (``flare_server``): every ``flare_*`` series carries ``model_name``; the queue,
prefill and decode histograms, prompt and generation length histograms, KV usage as a
fraction, prefix-cache queries and hits and the preemption counter appear and move when
requests are served; ``process_*`` series are there, ``_created`` ones are not, and the
request histograms reach half an hour."""

from __future__ import annotations

import httpx
import pytest
import trio
from http_harness import raw_post, receive_until
from prometheus_client.parser import text_string_to_metric_families

from app import AppSettings
from app.metrics import length_buckets
from ops.testing import FlareServer

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
MODEL = "served-name"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 3
"""Long enough (over two 16-token pages) for the second request to hit the cache."""


@pytest.fixture
def flare_app_settings() -> AppSettings:
    return AppSettings(served_model_name=MODEL)


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return parse(response.text)


async def complete(client: httpx.AsyncClient, max_tokens: int) -> dict[str, object]:
    response = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


HISTOGRAMS = ("flare_request_queue_time_seconds", "flare_request_prefill_time_seconds",
              "flare_request_decode_time_seconds", "flare_request_inference_time_seconds",
              "flare_request_prompt_tokens", "flare_request_generation_tokens",
              "flare_time_to_first_token_seconds", "flare_e2e_request_latency_seconds")


async def test_series_carry_model_name_and_move_when_requests_are_served(
        flare_server: FlareServer) -> None:
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=flare_server.url, timeout=30) as client:
            before = await scrape(client)
            first = await complete(client, 6)
            second = await complete(client, 4)
            after = await scrape(client)
    prompt_tokens = first["usage"]["prompt_tokens"]  # type: ignore[index]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
    assert cached > 0
    flare = [(name, dict(labels)) for name, labels in after if name.startswith("flare_")]
    assert flare and all(labels.get("model_name") == MODEL for _, labels in flare)
    for name in HISTOGRAMS:
        assert value(after, name + "_count") - value(before, name + "_count") == 2, name
    assert value(after, "flare_request_prompt_tokens_sum") == 2 * prompt_tokens
    assert value(after, "flare_request_generation_tokens_sum") == 6 + 4
    assert value(after, "flare_request_decode_time_seconds_sum") > 0
    assert value(after, "flare_prefix_cache_queries_total") == 2 * prompt_tokens
    assert value(after, "flare_prefix_cache_hits_total") == cached
    assert ("flare_num_preemptions_total", (("model_name", MODEL),)) in after
    assert value(after, "flare_num_preemptions_total") == 0  # flare never preempts
    assert ("flare_admission_reordered_total", (("model_name", MODEL),)) in after
    assert value(after, "flare_admission_reordered_total") == 0  # FIFO by default
    assert value(after, "flare_e2e_request_latency_seconds_bucket", le="1800.0") == 2
    assert value(after, "flare_time_to_first_token_seconds_bucket", le="1200.0") == 2
    assert not [name for name, _ in after if name.endswith("_created")]
    assert after[("process_cpu_seconds_total", ())] > 0
    assert after[("process_resident_memory_bytes", ())] > 0


async def test_kv_cache_usage_is_a_fraction_that_rises_while_a_request_runs(
        flare_server: FlareServer) -> None:
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=flare_server.url, timeout=30) as client:
            idle = await scrape(client)
            stream = await raw_post(flare_server.handle, "/v1/completions", {
                "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True})
            async with stream:
                await receive_until(stream, b"data: ")
                busy = await scrape(client)
    used = value(busy, "flare_kv_pages_used")
    total = value(busy, "flare_kv_pages_total")
    assert value(idle, "flare_kv_cache_usage_perc") == 0
    assert used > 0
    assert value(busy, "flare_kv_cache_usage_perc") == pytest.approx(used / total)
    assert 0 < value(busy, "flare_kv_cache_usage_perc") < 1


def test_length_buckets_follow_1_2_5_up_to_the_context() -> None:
    assert length_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 2048)
    assert length_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert length_buckets(1) == (1,)
