"""Tool calling end to end: the official ``openai`` client against the real runtime and
the embedded default model. ``required`` and named ``tool_choice`` constrain the tiny
model's output, so its calls parse and their arguments validate against the tools'
schemas, streaming and not (the same seed gives the same calls both ways)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import trio
from scheduler_client import OpenRuntime
from test_openai_real_runtime import served

pytestmark = pytest.mark.slow
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
CHOICES: list[Any] = ["required", {"type": "function", "function": {"name": "get_weather"}}]


def calls_of_stream(stream: Any) -> tuple[list[tuple[str, str]], str]:
    calls: list[list[str]] = []
    finish = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                calls.append([delta.function.name, ""])
            calls[delta.index][1] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(name, arguments) for name, arguments in calls], finish


async def test_required_and_named_calls_validate(real_open_runtime: OpenRuntime) -> None:
    with trio.fail_after(300):
        async with served(real_open_runtime) as (server, runtime):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)

            def run() -> list[tuple[Any, ...]]:
                results = []
                for choice in CHOICES:
                    kwargs: dict[str, Any] = dict(
                        model=runtime.model_name, messages=MESSAGES, tools=TOOLS,
                        tool_choice=choice, parallel_tool_calls=False, max_tokens=48, seed=3)
                    whole = client.chat.completions.create(**kwargs)
                    with client.chat.completions.create(stream=True, **kwargs) as stream:
                        results.append((choice, whole, *calls_of_stream(stream)))
                return results

            results = await trio.to_thread.run_sync(run)
            client.close()
    for choice, whole, streamed_calls, streamed_finish in results:
        message = whole.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert whole.choices[0].finish_reason == streamed_finish == "tool_calls"
        assert message.content is None and len(calls) == 1  # parallel_tool_calls false
        assert all(c.id.startswith("call_") for c in message.tool_calls or [])
        if choice != "required":
            assert calls[0][0] == "get_weather"
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert streamed_calls == calls
