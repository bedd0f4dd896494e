"""Structured-output fields parsed into one ``GrammarSpec`` (``app.structured_fields``):
every spelling a client may send reaches the runtime as the same constraint, and a
malformed one is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from actors import GrammarSpec
from app.errors import ApiError
from app.request_parsing import parse_chat, parse_completion

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}},
     GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     GrammarSpec("json_object")),
    ({"guided_json": SCHEMA}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, GrammarSpec("regex", "[0-9]+")),
    ({"guided_choice": ["a", "b"]}, GrammarSpec("choice", '["a", "b"]')),
    ({"guided_grammar": 'start: "x"'}, GrammarSpec("grammar", 'start: "x"')),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "a+"}}, GrammarSpec("regex", "a+")),
    ({"structured_outputs": {"choice": ["x"]}}, GrammarSpec("choice", '["x"]')),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, GrammarSpec("grammar", 'start: "x"')),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object")),
])
def test_every_spelling_reaches_the_request(fields: dict[str, Any],
                                            expected: GrammarSpec | None) -> None:
    chat = parse_chat({"messages": MESSAGES, **fields})
    completion = parse_completion({"prompt": "x", **fields})
    assert chat.common.grammar == completion.common.grammar == expected


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                 "strict": "yes"}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_json": {"type": "integer", "minimum": "zero"}}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": "start: missing"}, "guided_grammar"),
    ({"structured_outputs": []}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_malformed_or_conflicting_constraints_name_the_field(fields: dict[str, Any],
                                                             param: str) -> None:
    for parse, body in ((parse_chat, {"messages": MESSAGES}), (parse_completion,
                                                               {"prompt": "x"})):
        with pytest.raises(ApiError) as caught:
            parse({**body, **fields})
        assert (caught.value.status, caught.value.param) == (400, param)
