"""The official ``openai`` client against ``flare``'s HTTP server on the real runtime and
the embedded default model: completions and chat, streaming and not, usage exact.

The sync client runs in a worker thread (``trio.to_thread.run_sync``); see
``tests/app/test_http_openai_client.py`` for why not the async one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai
import pytest
import trio
from scheduler_client import OpenRuntime

from actors.config import RuntimeConfig
from actors.public import Runtime
from app import ServerHandle
from ops.testing import serve_app

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"}]


@asynccontextmanager
async def served(open_runtime: OpenRuntime) -> AsyncIterator[tuple[ServerHandle, Runtime]]:
    config = RuntimeConfig(max_batch=4, prefill_capacities=(64, 256))
    async with open_runtime(config) as runtime, serve_app(runtime) as server:
        yield server, runtime


async def test_openai_client_completions_and_chat(real_open_runtime: OpenRuntime) -> None:
    with trio.fail_after(300):
        async with served(real_open_runtime) as (server, runtime):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            model = runtime.model_name
            prompt = "import os\n\ndef main():\n"
            prompt_tokens = len(runtime.codec.encode(prompt))

            def run() -> tuple[object, ...]:
                whole = client.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True})
                with client.completions.create(
                        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True}) as stream:
                    chunks = list(stream)
                chat = client.chat.completions.create(model=model, messages=MESSAGES,
                                                      max_tokens=8, seed=5)
                with client.chat.completions.create(
                        model=model, messages=MESSAGES, max_tokens=8, seed=5, stream=True,
                        stream_options={"include_usage": True}) as stream:
                    chat_chunks = list(stream)
                return whole, chunks, chat, chat_chunks

            whole, chunks, chat, chat_chunks = await trio.to_thread.run_sync(run)
            client.close()
    assert whole.usage.prompt_tokens == prompt_tokens  # type: ignore[attr-defined]
    assert whole.usage.completion_tokens == 12  # type: ignore[attr-defined]
    assert whole.choices[0].finish_reason == "length"  # type: ignore[attr-defined]
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)  # type: ignore[attr-defined]
    assert streamed == whole.choices[0].text  # type: ignore[attr-defined]  # greedy: same text
    assert chunks[-1].usage.completion_tokens == 12  # type: ignore[attr-defined]
    usage = chat.usage  # type: ignore[attr-defined]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= 8
    chat_text = "".join(c.choices[0].delta.content or ""  # type: ignore[attr-defined]
                        for c in chat_chunks if c.choices)  # type: ignore[attr-defined]
    assert chat_text == chat.choices[0].message.content  # type: ignore[attr-defined]  # same seed
    assert chat_chunks[-1].usage.prompt_tokens == usage.prompt_tokens  # type: ignore[attr-defined]
