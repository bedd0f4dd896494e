"""Tool calls parsed from output text: the Hermes ``<tool_call>`` format (``auto``), a
named function's arguments and ``required``'s array; streaming and whole-text parsing
agree; the constraint built for ``required`` and named choices accepts exactly calls."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from actors import GrammarSpec, grammar_problem
from app.tool_calls import (
    ArrayParser,
    CallArguments,
    CallStart,
    Content,
    HermesParser,
    Piece,
    ToolCallStream,
    apply_to_body,
    parser_for,
)
from app.tool_fields import ToolRequest, constraint_schema, parse_tool_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def tool_request(choice: Any = None, *, parallel: bool | None = None) -> ToolRequest:
    body: dict[str, Any] = {"tools": [WEATHER, TIME]}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    request = parse_tool_request(body)
    assert request is not None
    return request


def calls_and_content(pieces: list[Piece]) -> tuple[list[tuple[str, str]], str]:
    names: list[str] = []
    arguments: list[str] = []
    for piece in pieces:
        if isinstance(piece, CallStart):
            assert piece.index == len(names) and piece.id.startswith("call_")
            names.append(piece.name)
            arguments.append("")
        elif isinstance(piece, CallArguments):
            arguments[piece.index] += piece.text
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    return list(zip(names, arguments, strict=True)), content


def whole(parser: Any, text: str) -> list[Piece]:
    return [*parser.feed(text), *parser.finish()]


def char_by_char(parser: Any, text: str) -> list[Piece]:
    pieces: list[Piece] = []
    for char in text:
        pieces += parser.feed(char)
    return pieces + parser.finish()


HERMES_TWO_CALLS = (
    "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
    "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
    "\"arguments\": {}}\n</tool_call>\n")


@pytest.mark.parametrize("feed", [whole, char_by_char], ids=["whole", "streamed"])
def test_hermes_calls_and_content(feed: Any) -> None:
    calls, content = calls_and_content(feed(HermesParser(parallel=True), HERMES_TWO_CALLS))
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert content == "Let me check."  # the whitespace around the calls is not content


@pytest.mark.parametrize("feed", [whole, char_by_char], ids=["whole", "streamed"])
def test_hermes_without_a_call_is_all_content(feed: Any) -> None:
    text = "Use a <tool> like x < y and <tool_cal without closing.\n"
    calls, content = calls_and_content(feed(HermesParser(parallel=True), text))
    assert calls == [] and content == text


def test_hermes_holds_back_what_could_start_a_call() -> None:
    parser = HermesParser(parallel=True)
    assert parser.feed("Hi <tool_") == [Content("Hi")]  # " <tool_" could begin a call
    assert parser.feed("x") == [Content(" <tool_x")]  # it did not
    assert parser.feed("\n\n") == []
    assert parser.finish() == [Content("\n\n")]


@pytest.mark.parametrize("feed", [whole, char_by_char], ids=["whole", "streamed"])
def test_hermes_malformed_block_stays_content(feed: Any) -> None:
    text = "See:\n <tool_call>\nnot json\n</tool_call> after"
    calls, content = calls_and_content(feed(HermesParser(parallel=True), text))
    assert calls == [] and content == text


def test_hermes_unclosed_block_at_the_end() -> None:
    """A call the model ended without its closing tag is still a call; a cut-off one is
    returned as content."""
    done = '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    assert calls_and_content(whole(HermesParser(parallel=True), done)) == (
        [("get_time", "{}")], "")
    cut = '<tool_call>\n{"name": "get_time", "argu'
    assert calls_and_content(whole(HermesParser(parallel=True), cut)) == ([], cut)


def test_hermes_parallel_false_returns_the_first_call_only() -> None:
    calls, _ = calls_and_content(whole(HermesParser(parallel=False), HERMES_TWO_CALLS))
    assert calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("feed", [whole, char_by_char], ids=["whole", "streamed"])
def test_required_array(feed: Any) -> None:
    text = ('[{"name":"get_weather","arguments":{"city":"a]}\\"b"}},'
            '{"name":"get_time","arguments":{}}]')
    calls, content = calls_and_content(feed(ArrayParser(), text))
    assert calls == [("get_weather", '{"city": "a]}\\"b"}'), ("get_time", "{}")]
    assert content == ""


def test_required_array_cut_off_keeps_the_rest_as_content() -> None:
    text = '[{"name":"get_time","arguments":{}},{"name":"get_wea'
    calls, content = calls_and_content(whole(ArrayParser(), text))
    assert calls == [("get_time", "{}")]
    assert content == '{"name":"get_wea'
    assert calls_and_content(whole(ArrayParser(), "no array")) == ([], "no array")


def test_named_output_is_the_arguments() -> None:
    parser = parser_for(tool_request({"type": "function", "function": {"name": "get_weather"}}))
    assert parser is not None
    calls, content = calls_and_content(char_by_char(parser, '{"city":"Oslo"}'))
    assert calls == [("get_weather", '{"city":"Oslo"}')] and content == ""


def test_none_parses_nothing() -> None:
    assert parser_for(tool_request("none")) is None
    body = {"choices": [{"index": 0, "message": {"role": "assistant",
                                                  "content": HERMES_TWO_CALLS},
                         "finish_reason": "stop"}]}
    assert apply_to_body(body, tool_request("none"))["choices"][0]["message"] == {
        "role": "assistant", "content": HERMES_TWO_CALLS}


def test_body_gets_tool_calls_and_finish_reason() -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant",
                                                  "content": HERMES_TWO_CALLS},
                         "finish_reason": "stop"}]}
    choice = apply_to_body(body, tool_request())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_weather", "get_time"]
    assert choice["message"]["content"] == "Let me check."


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}


def test_stream_rewrite_emits_openai_tool_call_deltas() -> None:
    stream = ToolCallStream(tool_request())
    out = stream.rewrite(chunk({"role": "assistant", "content": ""}))
    for piece in HERMES_TWO_CALLS:
        out += stream.rewrite(chunk({"content": piece}))
    out += stream.rewrite(chunk({}, "stop"))
    out += stream.rewrite({"id": "chatcmpl-x", "choices": [], "usage": {}})
    deltas = [c["choices"][0]["delta"] for c in out if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [set(c) for c in calls] == [{"index", "id", "type", "function"}, {"index", "function"}] * 2
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1]["function"] == {"arguments": '{"city": "Paris"}'}
    assert (calls[2]["index"], calls[2]["function"]["name"]) == (1, "get_time")
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    finishes = [c["choices"][0]["finish_reason"] for c in out if c["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert out[-1]["choices"] == []  # usage passes through


def test_required_constraint_accepts_exactly_calls() -> None:
    schema = constraint_schema(tool_request("required"))
    assert schema is not None
    assert grammar_problem(GrammarSpec("json_schema", json.dumps(schema))) is None
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for wrong in ([], [{"name": "get_weather", "arguments": {}}],
                  [{"name": "get_weather", "arguments": {"city": "Rome", "x": 1}}],
                  [{"name": "launch", "arguments": {}}], {"name": "get_time", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = constraint_schema(tool_request("required", parallel=False))
    assert single is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, single)


def test_named_constraint_is_the_parameters_schema() -> None:
    request = tool_request({"type": "function", "function": {"name": "get_weather"}})
    assert constraint_schema(request) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert constraint_schema(tool_request("auto")) is None
    assert constraint_schema(tool_request("none")) is None


def test_auto_without_tools_parses_nothing() -> None:
    request = parse_tool_request({"tool_choice": "auto"})
    assert request is not None and request.mode == "none" and parser_for(request) is None
