"""Structured output through the official ``openai`` client, on the real runtime and the
embedded default model: ``response_format`` (json_object, json_schema) and vLLM's
``guided_*`` / ``structured_outputs`` fields on chat and completions, streaming and not.

The embedded model is tiny and produces no JSON of its own, so every output parsing
and validating (``jsonschema``) at temperature 1 over several seeds is the grammar
mask's doing. The sync client runs in a worker thread (see
``tests/app/test_http_openai_client.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import jsonschema
import openai
import pytest
import trio
from scheduler_client import OpenRuntime

from actors.config import RuntimeConfig
from app import AppSettings, ServerHandle, create_app, serve_http

pytestmark = pytest.mark.slow
T = TypeVar("T")
SEEDS = (0, 1, 2)
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                 "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
SUM_GRAMMAR = 'start: NUMBER ("+" NUMBER)*\nNUMBER: /[1-9][0-9]?/\n'
"""A small Lark grammar: sums of one- or two-digit numbers."""
SUM = re.compile(r"[1-9][0-9]?(\+[1-9][0-9]?)*")


@asynccontextmanager
async def served(open_runtime: OpenRuntime) -> AsyncIterator[openai.OpenAI]:
    config = RuntimeConfig(max_batch=4, prefill_capacities=(64, 256), capture_forward=False)
    async with open_runtime(config) as runtime, trio.open_nursery() as nursery:
        server: ServerHandle = await nursery.start(partial(
            serve_http, create_app(runtime, AppSettings()), host="127.0.0.1", port=0))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        try:
            yield client
        finally:
            client.close()
            await server.shutdown(grace_s=0)


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def _chat(client: openai.OpenAI, *, seed: int, stream: bool, max_tokens: int = 160,
          **fields: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of one chat completion at temperature 1."""
    extra = {k: v for k, v in fields.items() if k != "response_format"}
    kwargs: dict[str, Any] = dict(model="default", messages=MESSAGES, temperature=1.0,
                                  seed=seed, max_tokens=max_tokens, extra_body=extra)
    if "response_format" in fields:
        kwargs["response_format"] = fields["response_format"]
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    text, finish = [], None
    with client.chat.completions.create(stream=True, **kwargs) as chunks:
        for chunk in chunks:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def _completion(client: openai.OpenAI, *, seed: int, stream: bool, max_tokens: int = 160,
                **fields: Any) -> tuple[str, str | None]:
    kwargs: dict[str, Any] = dict(model="default", prompt="Answer:", temperature=1.0,
                                  seed=seed, max_tokens=max_tokens, extra_body=fields)
    if not stream:
        reply = client.completions.create(**kwargs)
        return reply.choices[0].text, reply.choices[0].finish_reason
    text, finish = [], None
    with client.completions.create(stream=True, **kwargs) as chunks:
        for chunk in chunks:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def _outputs(client: openai.OpenAI, route: Callable[..., tuple[str, str | None]],
             *, complete: bool = True, **fields: Any) -> list[str]:
    """Texts for every seed, streaming and not. With ``complete`` each must have
    finished because the grammar was complete (``stop``); otherwise only those are
    returned (an unbounded grammar may run into ``max_tokens`` at temperature 1)."""
    texts = []
    for seed in SEEDS:
        for stream in (False, True):
            text, finish = route(client, seed=seed, stream=stream, **fields)
            assert finish == "stop" or (not complete and finish == "length"), (
                fields, seed, stream, text)
            if finish == "stop":
                texts.append(text)
    return texts


async def test_json_outputs_parse_and_validate(real_open_runtime: OpenRuntime) -> None:
    """response_format json_object / json_schema on chat, guided_json on completions
    and structured_outputs.json: every output is JSON that validates against its
    schema (required fields, enums, bounded integers, arrays, a nested object), and
    ends with ``stop`` as soon as the schema is complete. Any-object outputs that
    finish parse as objects."""
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with trio.fail_after(600):
        async with served(real_open_runtime) as client:
            def run() -> dict[str, list[str]]:
                return {
                    "object": _outputs(client, _chat, complete=False,
                                       response_format={"type": "json_object"})
                    + _outputs(client, _completion, complete=False,
                               structured_outputs={"json_object": True}),
                    "chat": _outputs(client, _chat, response_format=schema_format),
                    "guided": _outputs(client, _completion, guided_json=PERSON),
                    "structured": _outputs(client, _completion,
                                           structured_outputs={"json": PERSON}),
                }
            texts = await in_thread(run)
    assert texts["object"]  # any JSON object: its strings are unbounded
    for text in texts["object"]:
        assert isinstance(json.loads(text), dict)
    people = [json.loads(t) for t in texts["chat"] + texts["guided"] + texts["structured"]]
    for person in people:
        jsonschema.validate(person, PERSON)
    assert len({json.dumps(p) for p in people}) > 1  # temperature 1 really samples


async def test_regex_choice_grammar_and_cut_off(real_open_runtime: OpenRuntime) -> None:
    """guided_regex, guided_choice, guided_grammar (Lark) and structured_outputs on
    chat and completions match exactly; a max_tokens cut-off ends with finish_reason
    length (the output may then be incomplete)."""
    choices = ["red", "green", "blue violet"]
    with trio.fail_after(600):
        async with served(real_open_runtime) as client:
            def run() -> dict[str, Any]:
                return {
                    "regex": _outputs(client, _chat, guided_regex=EMAIL)
                    + _outputs(client, _completion, structured_outputs={"regex": EMAIL}),
                    "choice": _outputs(client, _completion, guided_choice=choices)
                    + _outputs(client, _chat, structured_outputs={"choice": choices}),
                    "grammar": _outputs(client, _completion, guided_grammar=SUM_GRAMMAR),
                    "cut": [_chat(client, seed=seed, stream=stream, max_tokens=3,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "person", "schema": PERSON}})
                            for seed in SEEDS for stream in (False, True)],
                }
            out = await in_thread(run)
    assert all(re.fullmatch(EMAIL, t) for t in out["regex"]), out["regex"]
    assert all(t in choices for t in out["choice"]), out["choice"]
    assert all(SUM.fullmatch(t) for t in out["grammar"]), out["grammar"]
    for text, finish in out["cut"]:
        forced = '{"name":"'  # what the schema allows first, whatever the model prefers
        assert finish == "length" and text and (forced.startswith(text)
                                                or text.startswith(forced)), text


async def test_bad_constraints_are_a_400_naming_the_field(
    real_open_runtime: OpenRuntime,
) -> None:
    """A schema, regex, choice list or grammar that does not compile, a malformed
    response_format and two constraints at once: each a 400 whose param names the
    field, before anything runs."""
    cases: list[tuple[str, dict[str, Any]]] = [
        ("guided_json", {"guided_json": {"type": "nonsense"}}),
        ("guided_regex", {"guided_regex": "[a-z"}),
        ("guided_choice", {"guided_choice": []}),
        ("guided_grammar", {"guided_grammar": "start: undefined_rule"}),
        ("response_format", {"response_format": {"type": "json_schema",
                                                 "json_schema": {"schema": 3}}}),
        ("response_format", {"response_format": {"type": "yaml"}}),
        ("structured_outputs", {"structured_outputs": {"regex": "(", "json": {}}}),
        ("guided_regex", {"guided_json": {"type": "object"}, "guided_regex": "a"}),
    ]
    with trio.fail_after(300):
        async with served(real_open_runtime) as client:
            def run() -> list[tuple[str, int, str | None]]:
                seen = []
                for expected, body in cases:
                    for create in (partial(client.chat.completions.create,
                                           messages=MESSAGES),
                                   partial(client.completions.create, prompt="x")):
                        try:
                            create(model="default", max_tokens=4, extra_body=body)
                        except openai.BadRequestError as exc:
                            seen.append((expected, exc.status_code, exc.param))
                        else:
                            seen.append((expected, 200, None))
                return seen
            seen = await in_thread(run)
    assert seen == [(expected, 400, expected) for expected, _ in cases for _ in range(2)]
