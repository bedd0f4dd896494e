"""Access defaults: POST bodies must be declared JSON (415 otherwise), CORS only for the
configured origins, API keys compared as UTF-8 bytes, ``/metrics`` behind the key when
asked, and KV page figures that separate requests from the prefix cache."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server

from actors.config import ConfigError
from app import AppSettings
from ops import cli
from ops.run_command import build_app_settings

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "flare-test", "prompt": "Hello", "max_tokens": 3}).encode()
ORIGIN = "https://app.example.com"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def assert_415(response: httpx.Response) -> None:
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert error["param"] == "Content-Type"
    assert "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize("content_type", [
    None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/json; charset=latin-1"])
async def test_a_post_not_declared_json_is_415(codec: TinyCodec,
                                               content_type: str | None) -> None:
    rt = FakeRuntime(codec)
    headers = {} if content_type is None else {"Content-Type": content_type}
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            for path in (COMPLETIONS, CHAT):
                assert_415(await client.post(path, content=BODY, headers=headers))
            ok = await client.post(COMPLETIONS, content=BODY,
                                   headers={"Content-Type": "application/json; charset=utf-8"})
            assert ok.status_code == 200, ok.text
            metrics = (await client.get("/metrics")).text
    assert len(rt.requests) == 1
    assert 'flare_http_errors_total{model_name="flare-test",status="415"} 2.0' in metrics


async def test_no_cors_headers_by_default(codec: TinyCodec) -> None:
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec)) as server, client_for(server) as client:
            preflight = await client.options(COMPLETIONS, headers=PREFLIGHT)
            answer = await client.post(COMPLETIONS, content=BODY, headers={
                "Origin": ORIGIN, "Content-Type": "application/json"})
    assert answer.status_code == 200
    for response in (preflight, answer):
        assert not any(h.lower().startswith("access-control-") for h in response.headers)


async def test_allowed_origins_get_cors_headers_others_none(codec: TinyCodec) -> None:
    settings = AppSettings(allowed_origins=(ORIGIN,), api_key="sekrit")
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec), settings) as server, \
                client_for(server) as client:
            preflight = await client.options(COMPLETIONS, headers=PREFLIGHT)
            answer = await client.post(COMPLETIONS, content=BODY, headers={
                "Origin": ORIGIN, "Content-Type": "application/json",
                "Authorization": "Bearer sekrit"})
            refused = await client.post(COMPLETIONS, content=BODY, headers={
                "Origin": ORIGIN, "Content-Type": "application/json"})
            other = await client.options(COMPLETIONS, headers={
                **PREFLIGHT, "Origin": "https://evil.example"})
    assert preflight.status_code == 204  # a preflight carries no key and needs none
    assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert answer.status_code == 200
    assert answer.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert refused.status_code == 401  # errors are readable by the page too
    assert refused.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "access-control-allow-origin" not in other.headers


async def test_a_non_ascii_api_key_matches_its_utf8_bytes(codec: TinyCodec) -> None:
    key = "clé-ключ-鍵"
    rt = FakeRuntime(codec)
    with trio.fail_after(20):
        async with running_server(rt, AppSettings(api_key=key)) as server, \
                client_for(server) as client:
            headers = {"Content-Type": "application/json"}
            good = await client.post(COMPLETIONS, content=BODY, headers={
                **headers, "Authorization": b"Bearer " + key.encode("utf-8")})
            latin = await client.post(COMPLETIONS, content=BODY, headers={
                **headers, "Authorization": b"Bearer " + "clé".encode("latin-1")})
    assert good.status_code == 200, good.text
    assert latin.status_code == 401


@pytest.mark.parametrize("require", [False, True])
async def test_metrics_require_the_key_when_asked(codec: TinyCodec, require: bool) -> None:
    settings = AppSettings(api_key="sekrit", metrics_require_key=require)
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec), settings) as server, \
                client_for(server) as client:
            bare = await client.get("/metrics")
            keyed = await client.get("/metrics", headers={"Authorization": "Bearer sekrit"})
            health = await client.get("/health")
    assert bare.status_code == (401 if require else 200)
    assert keyed.status_code == 200
    assert "flare_kv_pages_cached" in keyed.text
    assert health.status_code == 200


def test_access_flags_reach_the_settings() -> None:
    argv = ["run", "--api-key", "k", "--metrics-require-key",
            "--allowed-origins", f"{ORIGIN}/, http://localhost:3000"]
    settings = build_app_settings(cli.build_parser(argv).parse_args(argv))
    assert settings.metrics_require_key
    assert settings.allowed_origins == (ORIGIN, "http://localhost:3000")


def test_metrics_require_key_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLARE_API_KEY", raising=False)
    argv = ["run", "--metrics-require-key"]
    with pytest.raises(ConfigError, match="--metrics-require-key needs --api-key"):
        build_app_settings(cli.build_parser(argv).parse_args(argv))
