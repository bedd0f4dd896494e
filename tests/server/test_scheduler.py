"""The seed's HTTP scheduler tests (Verification; VER-29..34) against the real runtime.

An idle server with four request slots (``max_batch=4``) and a 4096-token prefill
capacity (VER-29) is started in-process on an ephemeral loopback port through
``actors.system.open_runtime`` and serves the embedded default model. Each case is one
test (VER-30), parametrized over ordinary, fixed-width and adaptive speculative execution
(VER-31). Each prints prompt/output token counts, client SSE arrival gaps and graph-counter
deltas (VER-33); gaps are only printed, never compared with device times (VER-34).

VER-32 (decided for flare): the seed gates these tests on ``FLARE_RUN_CUDA_TESTS=1`` and an
external ``FLARE_SCHEDULER_TEST_URL``; flare runs them in-process on the cpu backend by
default (``FLARE_SCHEDULER_TEST_BACKEND=cuda`` selects the cuda backend), and they skip
with a reason while the runtime or the default model is missing. Run with ``-s`` to see
the reports.
"""

from __future__ import annotations

import importlib
import os
import pathlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from scheduler_client import (
    OpenRuntime,
    StreamResult,
    cancel_after_chunks,
    counter_deltas,
    report,
    scrape_counters,
    stream_completion,
)

from actors.config import DEFAULT_DRAFT_DIR, RuntimeConfig
from actors.public import Runtime
from app import ServerHandle
from ops.testing import serve_app

pytestmark = pytest.mark.slow

REQUEST_SLOTS = 4
PREFILL_CAPACITIES = (64, 256, 1024, 4096)
# VER-31: every case runs in ordinary, fixed-width and adaptive speculative execution
# (the speculative modes with the learned default draft, models/default-draft).
MODES = ("off", "fixed", "adaptive")
DEADLINE_S = 600
SURVIVOR_TOKENS = 192  # long enough to hold their two slots while the freed ones are reused
SOURCE_TEXT = "".join(pathlib.Path(importlib.import_module(name).__file__ or "").read_text()
                      for name in ("json.decoder", "textwrap", "fractions"))


@pytest.fixture
def open_runtime(real_open_runtime: OpenRuntime, mode: str) -> OpenRuntime:
    if mode != "off" and not (DEFAULT_DRAFT_DIR / "config.json").is_file():
        pytest.skip("models/default-draft is missing (needed for speculative modes)")
    return real_open_runtime


@dataclass
class Target:
    client: httpx.AsyncClient
    server: ServerHandle
    runtime: Runtime

    def prompt(self, tokens: int, *, offset: int = 0) -> list[int]:
        """Exactly ``tokens`` prompt tokens of real text (distinct per ``offset``)."""
        ids = self.runtime.codec.encode(SOURCE_TEXT[offset * 997:])
        while len(ids) < tokens:
            ids = ids + ids
        return ids[:tokens]

    @property
    def long_prompt_tokens(self) -> int:
        """A prompt that needs the large prefill capacity, within the context."""
        return max(256, min(3000, self.runtime.max_context - 128))


@asynccontextmanager
async def scheduler_server(open_runtime: OpenRuntime, mode: str) -> AsyncIterator[Target]:
    config = RuntimeConfig(
        max_batch=REQUEST_SLOTS, prefill_capacities=PREFILL_CAPACITIES, speculation=mode,  # type: ignore[arg-type]
        draft_model_dir=DEFAULT_DRAFT_DIR if mode != "off" else None,
        backend=os.environ.get("FLARE_SCHEDULER_TEST_BACKEND", "cpu"),  # type: ignore[arg-type]
        # What is scheduled does not depend on where the programs run, and a device
        # process traces its graphs anew for every runtime (seconds each); the device
        # process has its own runtime tests (tests/actors/test_runtime_device_process.py).
        device_process=False)
    config.validate()
    async with open_runtime(config) as runtime, serve_app(runtime) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
        yield Target(client=client, server=server, runtime=runtime)


async def run_all(*calls: Callable[[], Any]) -> list[StreamResult]:
    results: list[StreamResult | None] = [None] * len(calls)

    async def one(i: int, call: Callable[[], Any]) -> None:
        results[i] = await call()

    async with trio.open_nursery() as nursery:
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call)
    return [r for r in results if r is not None]


def assert_complete(result: StreamResult, *, prompt_tokens: int, max_tokens: int) -> None:
    assert result.error is None, f"{result.label}: {result.error}"
    assert result.done, f"{result.label}: no [DONE]"
    assert result.finish_reason == "length", result.label
    assert result.usage is not None
    assert result.usage["prompt_tokens"] == prompt_tokens, result.label
    assert result.usage["completion_tokens"] == max_tokens, result.label
    assert len(result.tokens) == max_tokens, result.label


async def solo_reference(target: Target, prompt: list[int], max_tokens: int) -> StreamResult:
    return await stream_completion(target.client, "solo", prompt, max_tokens)


def assert_matches_solo(result: StreamResult, solo: StreamResult, prefix: int = 8) -> None:
    """Greedy output under batching starts like the same prompt served alone (the first
    ``prefix`` tokens: later ones may legitimately diverge on fp ties across batch sizes)."""
    assert result.tokens[:prefix] == solo.tokens[:prefix], result.label


@pytest.mark.parametrize("mode", MODES)
async def test_ver_30_concurrent_long_prompts(open_runtime: OpenRuntime, mode: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with scheduler_server(open_runtime, mode) as t:
            n, out = t.long_prompt_tokens, 16
            prompts = [t.prompt(n, offset=i) for i in range(REQUEST_SLOTS)]
            before = await scrape_counters(t.client)
            results = await run_all(*(partial(stream_completion, t.client, f"long{i}", p, out)
                                      for i, p in enumerate(prompts)))
            report(f"concurrent long prompts [{mode}]", results,
                   counter_deltas(before, await scrape_counters(t.client)))
            solo = await solo_reference(t, prompts[0], out)
    for r in results:
        assert_complete(r, prompt_tokens=n, max_tokens=out)
    assert_matches_solo(results[0], solo)


@pytest.mark.parametrize("streams", [2, 4])
@pytest.mark.parametrize("mode", MODES)
async def test_ver_30_decode_streams(open_runtime: OpenRuntime, mode: str, streams: int) -> None:
    with trio.fail_after(DEADLINE_S):
        async with scheduler_server(open_runtime, mode) as t:
            out = 64
            prompts = [t.prompt(24, offset=i) for i in range(streams)]
            before = await scrape_counters(t.client)
            results = await run_all(*(partial(stream_completion, t.client, f"decode{i}", p, out)
                                      for i, p in enumerate(prompts)))
            report(f"{streams} decode streams [{mode}]", results,
                   counter_deltas(before, await scrape_counters(t.client)))
            solo = await solo_reference(t, prompts[0], out)
    for r in results:
        assert_complete(r, prompt_tokens=24, max_tokens=out)
    assert_matches_solo(results[0], solo)


@pytest.mark.parametrize("mode", MODES)
async def test_ver_30_long_prompt_arrives_during_decode(open_runtime: OpenRuntime, mode: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with scheduler_server(open_runtime, mode) as t:
            out, n = 96, t.long_prompt_tokens
            decoding = trio.Event()
            before = await scrape_counters(t.client)
            results: list[StreamResult] = []
            async with trio.open_nursery() as nursery:
                async def decoder(i: int) -> None:
                    results.append(await stream_completion(
                        t.client, f"decode{i}", t.prompt(24, offset=i), out,
                        chunks_seen=decoding, notify_after=8))

                for i in range(2):
                    nursery.start_soon(decoder, i)
                await decoding.wait()
                results.append(await stream_completion(t.client, "long-arrival",
                                                       t.prompt(n, offset=7), 16))
            report(f"long prompt during decode [{mode}]", results,
                   counter_deltas(before, await scrape_counters(t.client)))
    for r in results:
        long = r.label == "long-arrival"
        assert_complete(r, prompt_tokens=n if long else 24, max_tokens=16 if long else out)


@pytest.mark.parametrize("mode", MODES)
async def test_ver_30_short_long_prompt_contention(open_runtime: OpenRuntime, mode: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with scheduler_server(open_runtime, mode) as t:
            n, out = t.long_prompt_tokens, 24
            jobs = [("long0", n), ("short0", 32), ("long1", n), ("short1", 32)]
            before = await scrape_counters(t.client)
            results = await run_all(*(
                partial(stream_completion, t.client, label, t.prompt(size, offset=i), out)
                for i, (label, size) in enumerate(jobs)))
            report(f"short/long contention [{mode}]", results,
                   counter_deltas(before, await scrape_counters(t.client)))
    for r, (_, size) in zip(results, jobs, strict=True):
        assert_complete(r, prompt_tokens=size, max_tokens=out)


@pytest.mark.parametrize("mode", MODES)
async def test_ver_30_cancellation_then_slot_reuse(open_runtime: OpenRuntime, mode: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with scheduler_server(open_runtime, mode) as t:
            host, port = "127.0.0.1", t.server.port
            before = await scrape_counters(t.client)
            survivors: list[StreamResult] = []
            async with trio.open_nursery() as nursery:
                async def survivor(i: int) -> None:
                    survivors.append(await stream_completion(
                        t.client, f"survivor{i}", t.prompt(24, offset=i), SURVIVOR_TOKENS))

                for i in range(2):
                    nursery.start_soon(survivor, i)
                cancelled = await run_all(*(
                    partial(cancel_after_chunks, host, port, f"cancelled{i}",
                            t.prompt(24, offset=2 + i), 200, 3)
                    for i in range(2)))
                # All four slots were taken; the two freed slots must serve new requests.
                reused = await run_all(*(
                    partial(stream_completion, t.client, f"reuse{i}",
                            t.prompt(24, offset=4 + i), 32) for i in range(2)))
            report(f"cancellation then slot reuse [{mode}]", survivors + cancelled + reused,
                   counter_deltas(before, await scrape_counters(t.client)))
            stats = t.runtime.statistics()
    for r in cancelled:
        assert r.error is None
    for r in survivors:
        assert_complete(r, prompt_tokens=24, max_tokens=SURVIVOR_TOKENS)
    for r in reused:
        assert_complete(r, prompt_tokens=24, max_tokens=32)
    # The reused requests got the cancelled requests' slots: they finished while the
    # survivors (holding the other two slots) were still generating, instead of queueing
    # behind them.
    assert max(r.arrivals[-1] for r in reused) < min(r.arrivals[-1] for r in survivors)
    assert stats.requests_running == 0 and stats.requests_waiting == 0
