"""Tool calling through the official ``openai`` client (fake runtime, the embedded model's
chat template): ``required`` and named ``tool_choice`` constrain the output with a schema
built from the tools and answer ``tool_calls``; ``auto`` parses the Hermes format;
``none`` offers no tools; history with calls and tool results renders through the
template; malformed tool fields are 400s naming the field. Streaming and not."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import openai
import pytest
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server

T = TypeVar("T")
EMBEDDED_TEMPLATE = json.loads(
    (Path(__file__).resolve().parents[2] / "models" / "default" / "tokenizer_config.json")
    .read_text())["chat_template"]
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}},
                      "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def tool_codec(codec: TinyCodec) -> TinyCodec:
    return TinyCodec(codec.tokenizer, chat_template=EMBEDDED_TEMPLATE)


def runtime(codec: TinyCodec, reply: str = "Hello.") -> FakeRuntime:
    return FakeRuntime(codec, reply=reply, max_context=2048)  # the tools preamble is long


async def call(rt: FakeRuntime, fn: Callable[[openai.OpenAI], T]) -> T:
    with trio.fail_after(20):
        async with running_server(rt) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                   max_retries=0, timeout=10.0)
            try:
                return await trio.to_thread.run_sync(functools.partial(fn, client))
            finally:
                client.close()


def create(**kwargs: Any) -> Callable[[openai.OpenAI], Any]:
    return lambda client: client.chat.completions.create(
        model="flare-test", messages=kwargs.pop("messages", MESSAGES), max_tokens=200, **kwargs)


def streamed(**kwargs: Any) -> Callable[[openai.OpenAI], tuple[str | None, list[Any], str]]:
    """``(content, tool calls by index, finish_reason)`` accumulated from the chunks."""

    def run(client: openai.OpenAI) -> tuple[str | None, list[Any], str]:
        content: list[str] = []
        calls: list[dict[str, str]] = []
        finish = ""
        with create(stream=True, **kwargs)(client) as stream:
            for chunk in stream:
                choice = chunk.choices[0]
                content.append(choice.delta.content or "")
                for delta in choice.delta.tool_calls or []:
                    if delta.id is not None:  # the first delta of a call
                        assert delta.index == len(calls) and delta.type == "function"
                        assert delta.function is not None and delta.function.name
                        calls.append({"id": delta.id, "name": delta.function.name,
                                      "arguments": delta.function.arguments or ""})
                    else:
                        assert delta.function is not None and delta.function.name is None
                        calls[delta.index]["arguments"] += delta.function.arguments or ""
                finish = choice.finish_reason or finish
        return "".join(content) or None, calls, finish

    return run


def prompt_text(codec: TinyCodec, rt: FakeRuntime) -> str:
    return codec.decode(rt.requests[-1].prompt_token_ids)


def assert_valid_calls(calls: list[tuple[str, str, str]], names: list[str]) -> None:
    """Each call has an OpenAI id and arguments (JSON text) valid for its tool."""
    assert [name for _, name, _ in calls] == names
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_")
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def constraint(rt: FakeRuntime) -> dict[str, Any]:
    grammar = rt.requests[-1].grammar
    assert grammar is not None and grammar.kind == "json_schema"
    schema: dict[str, Any] = json.loads(grammar.source)
    return schema


Calls = list[tuple[str, str, str]] | None


async def answer(rt: FakeRuntime, stream: bool, **kwargs: Any) -> tuple[str | None, Calls, str]:
    """``(content, [(id, name, arguments)] or None, finish_reason)``, streamed or not."""
    if stream:
        content, raw, finish = await call(rt, streamed(**kwargs))
        return content, [(c["id"], c["name"], c["arguments"]) for c in raw] or None, finish
    result = await call(rt, create(**kwargs))
    message = result.choices[0].message
    calls = None if message.tool_calls is None else [
        (c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    return message.content, calls, result.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
async def test_required_answers_calls_valid_for_their_schemas(codec: TinyCodec,
                                                              stream: bool) -> None:
    codec = tool_codec(codec)
    reply = ('[{"name":"get_weather","arguments":{"city":"Paris","days":2}},'
             '{"name":"get_time","arguments":{}}]')
    rt = runtime(codec, reply=reply)
    content, calls, finish = await answer(rt, stream, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls" and content is None and calls is not None
    assert_valid_calls(calls, ["get_weather", "get_time"])
    jsonschema.validate(json.loads(reply), constraint(rt))  # the reply meets the constraint
    assert '"name": "get_weather"' in prompt_text(codec, rt)  # the tools were offered


@pytest.mark.parametrize("stream", [False, True])
async def test_named_choice_streams_the_arguments(codec: TinyCodec, stream: bool) -> None:
    codec = tool_codec(codec)
    reply = '{"city":"Paris"}'
    rt = runtime(codec, reply=reply)
    content, calls, finish = await answer(rt, stream, tools=TOOLS, tool_choice=NAMED)
    assert finish == "tool_calls" and content is None and calls is not None
    assert_valid_calls(calls, ["get_weather"])
    assert calls[0][2] == reply
    assert constraint(rt) == WEATHER_PARAMETERS


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_parses_a_call_in_the_output(codec: TinyCodec, stream: bool) -> None:
    codec = tool_codec(codec)
    reply = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>')
    rt = runtime(codec, reply=reply)
    content, calls, finish = await answer(rt, stream, tools=TOOLS, tool_choice="auto")
    assert (content, finish) == ("Checking.", "tool_calls") and calls is not None
    assert_valid_calls(calls, ["get_weather"])
    assert rt.requests[-1].grammar is None  # auto does not constrain the output
    assert "<tools>" in prompt_text(codec, rt)


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_without_a_call_is_plain_content(codec: TinyCodec, stream: bool) -> None:
    rt = runtime(tool_codec(codec), reply="It is sunny <b>today</b>.")
    assert await answer(rt, stream, tools=TOOLS) == ("It is sunny <b>today</b>.", None, "stop")


@pytest.mark.parametrize("stream", [False, True])
async def test_none_offers_no_tools_and_parses_nothing(codec: TinyCodec, stream: bool) -> None:
    codec = tool_codec(codec)
    reply = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    rt = runtime(codec, reply=reply)
    assert await answer(rt, stream, tools=TOOLS, tool_choice="none") == (reply, None, "stop")
    assert "<tools>" not in prompt_text(codec, rt) and rt.requests[-1].grammar is None


async def test_history_with_calls_and_results_renders_through_the_template(
        codec: TinyCodec) -> None:
    codec = tool_codec(codec)
    rt = runtime(codec, reply="It is sunny.")
    messages = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    result = await call(rt, create(messages=messages, tools=TOOLS))
    assert result.choices[0].message.content == "It is sunny."
    prompt = prompt_text(codec, rt)
    assert prompt.startswith("<|system|>\nBe brief.\n\n# Tools\n")
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|end|>\n') in prompt
    assert prompt.endswith("<|user|>\n<tool_response>\nsunny, 21C\n</tool_response><|end|>\n"
                           "<|assistant|>\n")
    # The message ends anchor the history, tool turns included.
    assert len(rt.requests[-1].message_ends) == len(messages)


async def test_tokenize_counts_the_prompt_chat_sends(codec: TinyCodec) -> None:
    """``/tokenize`` with ``tools`` renders the prompt a chat request with them gets."""
    rt = runtime(tool_codec(codec))
    result = await call(rt, create(tools=TOOLS))
    with trio.fail_after(20):
        async with running_server(rt) as server, client_for(server) as client:
            response = await client.post("/tokenize", json={"messages": MESSAGES,
                                                            "tools": TOOLS})
            plain = await client.post("/tokenize", json={"messages": MESSAGES})
    assert result.usage is not None
    assert response.json()["tokens"] == list(rt.requests[-1].prompt_token_ids)
    assert response.json()["count"] == result.usage.prompt_tokens > plain.json()["count"]


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [BAD_TOOL]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "extra_body": {"parallel_tool_calls": "yes"}}, "parallel_tool_calls"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 3}}]}]},
     "messages"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
])
async def test_malformed_tool_fields_are_400s_naming_the_field(
        codec: TinyCodec, fields: dict[str, Any], param: str) -> None:
    rt = runtime(tool_codec(codec))

    def refused(client: openai.OpenAI) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            create(**fields)(client)
        return info.value

    error = await call(rt, refused)
    assert error.status_code == 400 and error.param == param
    assert rt.requests == []
