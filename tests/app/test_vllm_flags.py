"""vLLM's spellings of ``flare run`` flags (docs/api.md, "vLLM flags") and what each
does: the flags reach the runtime and HTTP settings, any batch limit is respected,
several served names are accepted, a chat template replaces the tokenizer's, request
logs can be turned off, prefix caching can be turned off, and every value served
smaller than asked is a warning naming both values."""

from __future__ import annotations

import io
import json
import logging
import pathlib
from collections.abc import Iterator

import pytest
import structlog
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server

from actors.admission import AdmissionLimits, AdmissionState
from actors.catalog_setup import program_batch, state_rows_for
from actors.config import DEFAULT_MODEL_DIR, ConfigError, RuntimeConfig
from actors.context_sizing import DeviceMemory, pages_for_memory, serving_context, size_context
from actors.messages import Admit, RequestId
from actors.public import GenerationRequest, SamplingParams
from actors.system import open_runtime
from app import AppSettings
from app.log_config import configure_logging
from ops import cli
from ops.run_command import build_app_settings, build_runtime_config, quiet_request_logs

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def parse(*flags: str) -> tuple[RuntimeConfig, AppSettings]:
    argv = ["run", *flags]
    args = cli.build_parser(argv).parse_args(argv)
    return build_runtime_config(args), build_app_settings(args)


def test_vllm_spellings_reach_the_runtime_and_http_settings(tmp_path: pathlib.Path) -> None:
    config, settings = parse(
        str(DEFAULT_MODEL_DIR), "--max-model-len", "512", "--max-num-seqs", "12",
        "--max-num-batched-tokens", "512", "--served-model-name", "m", "n", "m",
        "--chat-template", TEMPLATE, "--enable-prefix-caching",
        "--gpu-memory-utilization", "0.85")
    assert (config.model_dir, config.max_context, config.max_batch) == (DEFAULT_MODEL_DIR, 512, 12)
    assert config.prefill_capacities == (64, 256, 512)
    assert (config.prefix_caching, config.gpu_memory_utilization) == (True, 0.85)
    assert (settings.served_model_name, settings.served_model_aliases) == ("m", ("n",))
    assert settings.chat_template == TEMPLATE
    config.validate()


def test_flare_spellings_mean_the_same() -> None:
    vllm, _ = parse(str(DEFAULT_MODEL_DIR), "--max-model-len", "300", "--max-num-seqs", "5")
    flare, _ = parse("--model", str(DEFAULT_MODEL_DIR), "--max-context", "300",
                     "--max-batch", "5")
    assert vllm == flare
    defaults, settings = parse()
    assert (defaults.model_dir, defaults.prefill_capacities, defaults.prefix_caching) == (
        DEFAULT_MODEL_DIR, (64, 256, 1024), True)
    assert (settings.served_model_name, settings.chat_template) == (None, None)


def test_chat_template_from_a_file_and_prefix_caching_off(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    config, settings = parse("--chat-template", str(path), "--no-enable-prefix-caching")
    assert settings.chat_template == TEMPLATE
    assert config.prefix_caching is False


@pytest.mark.parametrize(("prefix_caching", "expected"), [(True, True), (False, False)])
def test_without_prefix_caching_no_request_looks_the_cache_up(prefix_caching: bool,
                                                             expected: bool) -> None:
    state = AdmissionState(AdmissionLimits(max_context=64, vocab_size=100, max_queue=4,
                                           prefix_caching=prefix_caching))
    events_send, _ = trio.open_memory_channel[object](1)
    decision_send, _ = trio.open_memory_channel[object](1)
    request = GenerationRequest(prompt_token_ids=(5, 6, 7), max_tokens=2)
    assert state.on_admit(Admit(request_id=RequestId(1), request=request,
                                events=events_send, decision=decision_send)) is None  # type: ignore[arg-type]
    reply, _ = trio.open_memory_channel[object](1)
    acquire = state.acquire_for_head(reply)  # type: ignore[arg-type]
    assert acquire is not None and acquire.use_prefix_cache is expected


@pytest.mark.parametrize(("limit", "bucket", "rows"), [
    (1, 1, 2), (3, 4, 3), (5, 8, 5), (8, 8, 16), (12, 16, 12), (16, 16, 32), (64, 64, 128)])
def test_any_batch_limit_prepares_power_of_two_buckets_and_admits_at_most_n(
        limit: int, bucket: int, rows: int) -> None:
    """Programs come in power-of-two buckets; a limit that is none is enforced by
    keeping at most that many requests resident (so no decode batch exceeds it)."""
    assert (program_batch(limit), state_rows_for(limit)) == (bucket, rows)


async def test_a_batch_limit_of_three_never_decodes_four_requests() -> None:
    """Seven concurrent requests on the embedded model under ``--max-num-seqs 3``."""
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, max_batch=3, prefill_capacities=(64,),
                           max_context=128, capture_forward=False)
    greedy = SamplingParams(temperature=0.0)

    async def one(rt: object, seed: int) -> None:
        request = GenerationRequest(prompt_token_ids=(5 + seed, 9, 11), max_tokens=12,
                                    sampling=greedy, ignore_eos=True)
        async with rt.generate(request) as events:  # type: ignore[attr-defined]
            async for _ in events:
                pass

    with trio.fail_after(120):
        async with open_runtime(config) as rt:
            async with trio.open_nursery() as nursery:
                for seed in range(7):
                    nursery.start_soon(one, rt, seed)
            decodes = [f.lanes for f in rt.frame_log() if f.graph.startswith("decode")]
            rows = rt.resources.rows.total
    assert rows == 3  # at most three requests resident at once
    assert max(decodes) <= 3


def _adjusted(config: RuntimeConfig, model_max_context: int) -> list[dict[str, object]]:
    with structlog.testing.capture_logs() as logs:
        serving_context(config, model_max_context=model_max_context)
    return [{k: v for k, v in e.items() if k != "log_level"} for e in logs]


def test_a_context_above_the_models_is_lowered_with_a_warning() -> None:
    config = RuntimeConfig(max_context=4096)
    assert size_context(config, model_max_context=2048).max_context == 2048
    assert _adjusted(config, 2048) == [{
        "event": "config.adjusted", "flag": "--max-context", "value": 4096,
        "setting": "max_context", "asked": 4096, "used": 2048,
        "reason": "the model's max_position_embeddings"}]


def test_a_small_kv_pool_shrinking_the_context_is_a_warning() -> None:
    config = RuntimeConfig(kv_pages=4)
    sizing = size_context(config, model_max_context=2048)
    assert (sizing.max_context, sizing.num_pages) == (2048, 4)
    assert _adjusted(config, 2048) == [{
        "event": "config.adjusted", "flag": "--kv-pages", "value": 4,
        "setting": "max_context", "asked": 2048, "used": 64,
        "reason": "4 KV pages of 16 tokens hold 64 tokens"}]


def test_values_served_as_asked_warn_nothing() -> None:
    assert _adjusted(RuntimeConfig(max_context=2048, kv_pages=128), 2048) == []
    assert _adjusted(RuntimeConfig(), 2048) == []


def _adjusted_with(config: RuntimeConfig, memory: DeviceMemory | None
                   ) -> list[dict[str, object]]:
    with structlog.testing.capture_logs() as logs:
        serving_context(config, model_max_context=2048, memory=memory)
    return [{k: v for k, v in e.items() if k != "log_level"} for e in logs]


GIB = 2**30
DEVICE = DeviceMemory(free_bytes=70 * GIB, total_bytes=80 * GIB, weight_bytes=16 * GIB,
                      page_bytes=2 * 2**20)
"""An 80 GiB device with 10 GiB used by others, 16 GiB of weights, 2 MiB KV pages."""


def test_gpu_memory_utilization_without_device_memory_is_logged_as_ignored() -> None:
    config = RuntimeConfig(gpu_memory_utilization=0.9)
    [event] = _adjusted_with(config, None)
    assert (event["event"], event["flag"], event["value"]) == (
        "config.ignored", "--gpu-memory-utilization", 0.9)
    assert "no device memory" in str(event["reason"])
    assert size_context(config, model_max_context=2048) == size_context(
        RuntimeConfig(), model_max_context=2048)


def test_gpu_memory_utilization_sizes_the_pool_from_the_device_share() -> None:
    """The share of the device, less others' use, the weights and the reserve (5 % of
    the device, at least 512 MiB), in whole pages."""
    config = RuntimeConfig(gpu_memory_utilization=0.9)
    sizing = size_context(config, model_max_context=2048, memory=DEVICE)
    budget = int(0.9 * 80 * GIB) - 10 * GIB - 16 * GIB - 4 * GIB
    assert sizing.num_pages == budget // DEVICE.page_bytes == pages_for_memory(0.9, DEVICE)
    smaller = size_context(RuntimeConfig(gpu_memory_utilization=0.5), model_max_context=2048,
                           memory=DEVICE)
    assert smaller.num_pages == (40 * GIB - 30 * GIB) // DEVICE.page_bytes
    [event] = _adjusted_with(config, DEVICE)
    assert (event["event"], event["pages"]) == ("config.kv_pool", sizing.num_pages)


def test_kv_pages_win_over_the_memory_share() -> None:
    config = RuntimeConfig(gpu_memory_utilization=0.9, kv_pages=200)
    assert size_context(config, model_max_context=2048, memory=DEVICE).num_pages == 200
    [event] = _adjusted_with(config, DEVICE)
    assert event["event"] == "config.ignored" and "--kv-pages" in str(event["reason"])


def test_a_share_too_small_for_one_context_is_a_config_error() -> None:
    tight = DeviceMemory(free_bytes=80 * GIB, total_bytes=80 * GIB, weight_bytes=35 * GIB,
                         page_bytes=64 * 2**20)
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization 0\.5 leaves room for "
                                          r"\d+ KV pages, fewer than one 2048-token context"):
        size_context(RuntimeConfig(gpu_memory_utilization=0.5), model_max_context=2048,
                     memory=tight)


async def test_every_served_name_is_accepted_and_listed(codec: TinyCodec) -> None:
    settings = AppSettings(served_model_name="m", served_model_aliases=("n",))
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec), settings) as server, \
                client_for(server) as client:
            listed = (await client.get("/v1/models")).json()
            by_alias = await client.post("/v1/completions", json={
                "model": "n", "prompt": "Hi", "max_tokens": 2})
            card = await client.get("/v1/models/n")
            unknown = await client.post("/v1/completions", json={
                "model": "flare-test", "prompt": "Hi", "max_tokens": 2})
    assert [m["id"] for m in listed["data"]] == ["m", "n"]
    assert by_alias.status_code == 200 and by_alias.json()["model"] == "m"
    assert card.json()["id"] == "n"
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


async def test_a_chat_template_replaces_the_tokenizers(codec: TinyCodec) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec),
                                  AppSettings(chat_template=TEMPLATE)) as server, \
                client_for(server) as client:
            tokens = (await client.post("/tokenize", json={
                "messages": messages, "add_generation_prompt": False})).json()["tokens"]
    assert codec.decode(tokens) == "[user] hello there\n"


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    configure_logging("json", level="info", stream=out)
    yield out
    quiet_request_logs(False)
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("disabled", [False, True])
async def test_disable_log_requests_drops_per_request_records(
        codec: TinyCodec, log_stream: io.StringIO, disabled: bool) -> None:
    quiet_request_logs(disabled)
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server, client_for(server) as client:
            response = await client.post("/v1/completions", json={"prompt": "Hi",
                                                                  "max_tokens": 2})
    assert response.status_code == 200
    events = [json.loads(line)["event"] for line in log_stream.getvalue().splitlines()]
    requests = [e for e in events if e.startswith("request.")]
    assert requests == ([] if disabled else ["request.admitted", "request.first_token",
                                             "request.finished"])
