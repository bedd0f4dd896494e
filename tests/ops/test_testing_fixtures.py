"""flare's shipped pytest fixtures (``ops.pytest_plugin``): ``flare_runtime`` opens the
embedded default model quickly, ``flare_server`` serves it on a free loopback port with
addresses for httpx and the ``openai`` client, and both honour their config fixtures."""

from __future__ import annotations

import httpx
import pytest
import trio

from actors import GenerationRequest, Runtime, SamplingParams, TokenDelta
from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
from app import AppSettings
from ops.testing import FlareServer, quick_config


async def test_flare_runtime_generates_on_the_embedded_model(flare_runtime: Runtime) -> None:
    assert flare_runtime.model_name == DEFAULT_MODEL_DIR.name
    request = GenerationRequest(prompt_token_ids=tuple(flare_runtime.codec.encode("def f():")),
                                max_tokens=5, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0))
    tokens: list[int] = []
    with trio.fail_after(30):
        async with flare_runtime.generate(request) as events:
            async for event in events:
                if isinstance(event, TokenDelta):
                    tokens.extend(event.token_ids)
    assert len(tokens) == 5


def test_quick_config_starts_without_capture_and_takes_overrides() -> None:
    config = quick_config(max_context=128)
    assert (config.capture_forward, config.max_context) == (False, 128)
    assert config.model_dir == DEFAULT_MODEL_DIR
    config.validate()


async def test_flare_server_answers_on_loopback(flare_server: FlareServer) -> None:
    assert flare_server.url.startswith("http://127.0.0.1:")
    assert flare_server.base_url == flare_server.url + "/v1"
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=flare_server.base_url, timeout=20) as client:
            models = (await client.get("/models")).json()
            body = {"model": flare_server.model, "prompt": "x = ", "max_tokens": 3,
                    "ignore_eos": True}
            completion = (await client.post("/completions", json=body)).json()
    assert [m["id"] for m in models["data"]] == [flare_server.model]
    assert completion["usage"]["completion_tokens"] == 3


class TestOverriddenConfigFixtures:
    """A suite overrides ``flare_runtime_config`` and ``flare_app_settings`` (here for
    one class; usually in its ``conftest.py``)."""

    @pytest.fixture
    def flare_runtime_config(self) -> RuntimeConfig:
        return quick_config(max_context=96, max_batch=2)

    @pytest.fixture
    def flare_app_settings(self) -> AppSettings:
        return AppSettings(served_model_name="my-model", api_key="k")

    async def test_they_are_what_the_fixtures_open(self, flare_server: FlareServer) -> None:
        assert flare_server.runtime.max_context == 96
        assert flare_server.model == "my-model"
        with trio.fail_after(30):
            async with httpx.AsyncClient(base_url=flare_server.url, timeout=20) as client:
                refused = await client.get("/v1/models")
                keyed = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert (refused.status_code, keyed.status_code) == (401, 200)
