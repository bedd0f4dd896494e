"""Request features through HTTP: echo with prompt logprobs (scored prefill, OPEN-39),
stop strings, token-id prompts, chat anchors (QUEUE-16 / OPEN-23, OPEN-36), models,
health, metrics and the request lifecycle log events."""

from __future__ import annotations

import json

import structlog
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import SseReader, client_for, running_server
from prometheus_client.parser import text_string_to_metric_families

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
REPLY = "Hello world, this is a tiny reply."


async def test_open_39_echo_with_logprobs_uses_scored_prefill(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    prompt = "The quick brown fox"
    prompt_ids = codec.encode(prompt)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 0}
            whole = (await client.post(COMPLETIONS, json=body)).json()
            async with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
                events = await SseReader(r).rest()
            scoring = (await client.post(COMPLETIONS, json={**body, "max_tokens": 0})).json()
    choice = whole["choices"][0]
    assert choice["text"] == prompt + codec.decode(codec.encode(REPLY)[:3])
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 3
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1] == -1.01 and logprobs["token_logprobs"][-1] == -0.25
    assert logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert rt.requests[0].prompt_logprobs and rt.requests[0].logprobs
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == prompt
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert scoring["choices"][0]["text"] == prompt
    assert scoring["usage"]["completion_tokens"] == 0
    assert len(scoring["choices"][0]["logprobs"]["tokens"]) == len(prompt_ids)


async def test_stop_strings_and_token_id_prompt(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            ids = codec.encode("Hello")
            stopped = (await client.post(COMPLETIONS, json={
                "prompt": ids, "max_tokens": 50, "stop": " is"})).json()
            nested = (await client.post(COMPLETIONS, json={
                "prompt": [ids], "max_tokens": 50, "stop": ["zzz", "."], "ignore_eos": True,
                "user": "alice"})).json()
    assert stopped["choices"][0]["text"] == "Hello world, this"
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert rt.requests[0].prompt_token_ids == tuple(ids)
    assert rt.requests[1].prompt_token_ids == tuple(ids) and rt.requests[1].ignore_eos
    assert rt.requests[1].client == "alice"
    assert nested["choices"][0]["text"] == "Hello world, this is a tiny reply"


async def test_queue_16_chat_anchors_reach_the_runtime(codec: TinyCodec) -> None:
    """message_ends and system_end are exact token offsets of the rendered template."""
    rt = FakeRuntime(codec, reply=REPLY)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "Again"},
                                             {"type": "text", "text": ", please."}]}]
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            response = await client.post(CHAT, json={"messages": messages, "max_tokens": 4,
                                                     "logprobs": True})
            assert response.status_code == 200
            body = response.json()
    request = rt.requests[0]
    text = codec.decode(request.prompt_token_ids)
    assert text.startswith("<bos><|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nAgain, please.<|im_end|>\n<|im_start|>assistant\n")
    assert len(request.message_ends) == 4
    for end in request.message_ends:
        assert codec.decode(request.prompt_token_ids[:end]).endswith("<|im_end|>\n")
    assert request.system_end == request.message_ends[0]
    assert codec.decode(request.prompt_token_ids[request.message_ends[-1]:]) == (
        "<|im_start|>assistant\n")
    assert request.max_tokens == 4 and request.logprobs
    entries = body["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == [-0.25] * 4
    assert "".join(e["token"] for e in entries) == body["choices"][0]["message"]["content"]


async def test_chat_default_max_tokens_fills_the_context(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY, max_context=100)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            response = await client.post(CHAT, json={"messages": [
                {"role": "user", "content": "Hi"}]})
    assert response.status_code == 200
    request = rt.requests[0]
    assert request.max_tokens == 100 - len(request.prompt_token_ids)
    assert request.system_end is None


async def test_models_health_and_request_id_header(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, max_context=256)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            models = (await client.get("/v1/models")).json()
            health = await client.get("/health")
            response = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1})
    assert models["data"][0]["id"] == "flare-test"
    assert models["data"][0]["max_model_len"] == 256
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert response.headers["X-Request-Id"] == response.json()["id"]


MODEL = (("model_name", "flare-test"),)
"""The label every flare series carries: the served model name."""


def labels(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({**dict(MODEL), **extra}.items()))


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_metrics_expose_runtime_and_http_figures(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            for _ in range(2):
                await client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 4})
            async with client.stream("POST", CHAT, json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                    "stream": True}) as r:
                await SseReader(r).rest()
            response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    s = metric_samples(response.text)
    prompt_tokens = 2 * len(codec.encode("Hello")) + len(rt.requests[2].prompt_token_ids)
    assert s[("flare_scheduler_executions_total", labels(kind="decode"))] == 11
    assert s[("flare_scheduler_execution_nanoseconds_total", labels(kind="prefill"))] == 15000
    assert s[("flare_scheduler_graph_executions_total", labels(graph="decode_b1"))] == 11
    assert s[("flare_kv_pages_total", MODEL)] == 64
    assert s[("flare_requests_running", MODEL)] == 0
    assert s[("flare_prefix_cache_hit_tokens_total", MODEL)] == 5
    assert s[("flare_prompt_tokens_total", MODEL)] == prompt_tokens
    assert s[("flare_generation_tokens_total", MODEL)] == 11
    assert s[("flare_requests_finished_total", labels(reason="length"))] == 3
    assert s[("flare_time_to_first_token_seconds_count", MODEL)] == 3
    assert s[("flare_e2e_request_latency_seconds_count", MODEL)] == 3
    # one observation per token after each request's first: (4-1) + (4-1) + (3-1)
    assert s[("flare_inter_token_latency_seconds_count", MODEL)] == 8


async def test_lifecycle_log_events(codec: TinyCodec) -> None:
    rt = FakeRuntime(codec, reply=REPLY)
    with trio.fail_after(20), structlog.testing.capture_logs() as logs:
        async with running_server(rt) as server, client_for(server) as client:
            body = (await client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 4})
                    ).json()
    mine = [e for e in logs if e.get("request_id") == body["id"]]
    assert [e["event"] for e in mine] == ["request.admitted", "request.first_token",
                                          "request.finished"]
    admitted, first, finished = mine
    assert admitted["prompt_tokens"] == len(codec.encode("Hello"))
    assert admitted["max_tokens"] == 4 and admitted["stream"] is False
    assert admitted["endpoint"] == "completions"
    assert first["ttft_ms"] >= 0
    assert finished["finish_reason"] == "length"
    assert (finished["prompt_tokens"], finished["completion_tokens"]) == (
        len(codec.encode("Hello")), 4)
    assert finished["cached_prompt_tokens"] == 2 and finished["e2e_ms"] >= first["ttft_ms"]


async def test_large_bodies_are_prepared_off_the_event_loop(codec: TinyCodec) -> None:
    """Bodies past app.service.OFFLOAD_BYTES take the worker-thread path; results and
    errors are the same as inline."""
    from app.service import OFFLOAD_BYTES

    rt = FakeRuntime(codec, reply=REPLY, max_context=200_000)
    text = "The quick brown fox jumps over the lazy dog. " * (OFFLOAD_BYTES // 40)
    assert len(text) > OFFLOAD_BYTES
    with trio.fail_after(30):
        async with running_server(rt) as server, client_for(server) as client:
            ok = await client.post(COMPLETIONS, json={"prompt": text, "max_tokens": 2})
            chat = await client.post(CHAT, json={"messages": [{"role": "user", "content": text}],
                                                 "max_tokens": 2})
            bad = await client.post(COMPLETIONS, json={"prompt": text, "max_tokens": "x"})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(codec.encode(text))
    assert chat.status_code == 200
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
