"""Structured-output fields of a request body, parsed into one ``GrammarSpec``.

Read on ``/v1/completions`` and ``/v1/chat/completions`` alike:

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM's extra fields ``guided_json`` (a schema object or its JSON text),
  ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (Lark or
  GBNF), and newer vLLM's ``structured_outputs`` object with one of ``json``,
  ``regex``, ``choice``, ``grammar`` or ``json_object: true``.

At most one constraint per request. A malformed value, a schema, regex or grammar that
does not compile, or a second constraint is a 400 naming the field (pure: no I/O).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from actors import GrammarKind, GrammarSpec, grammar_problem
from app.errors import ApiError, bad_request

GUIDED_FIELDS: tuple[tuple[str, GrammarKind], ...] = (
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)
"""vLLM's extra fields and the constraint each one carries."""

STRUCTURED_OUTPUTS_KEYS: tuple[tuple[str, GrammarKind], ...] = (
    ("json", "json_schema"),
    ("regex", "regex"),
    ("choice", "choice"),
    ("grammar", "grammar"),
)
"""Keys of vLLM's ``structured_outputs`` object and their constraints."""


def structured_output_of(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The one output constraint ``body`` asks for, or None (raises a 400 ``ApiError``)."""
    found: list[tuple[str, GrammarSpec]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(("response_format", response_format))
    for name, kind in GUIDED_FIELDS:
        value = body.get(name)
        if value is not None:
            found.append((name, _spec(kind, value, param=name)))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        found.extend(_structured_outputs(outputs))
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad_request(f"'{second}' and '{first}' both constrain the output; send one.",
                          param=second)
    if not found:
        return None
    param, spec = found[0]
    problem = grammar_problem(spec)
    if problem is not None:
        raise bad_request(f"'{param}' does not compile: {problem}", param=param)
    return spec


def _response_format(value: Any) -> GrammarSpec | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a string 'type'.",
                          param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise bad_request(f"response_format type '{kind}' is not supported (text, "
                          "json_object, json_schema).", param=param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format 'json_schema' must be an object with a 'schema'.",
                          param=param)
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format json_schema 'name' must be a string.", param=param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format json_schema 'strict' must be a boolean.",
                          param=param)
    schema = spec.get("schema")
    if schema is None:  # OpenAI: a schema-less json_schema format is any JSON object
        return GrammarSpec("json_object")
    return _spec("json_schema", schema, param=param)


def _structured_outputs(value: Any) -> list[tuple[str, GrammarSpec]]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object.", param=param)
    found = [(param, _spec(kind, value[key], param=param))
             for key, kind in STRUCTURED_OUTPUTS_KEYS if value.get(key) is not None]
    json_object = value.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise bad_request("structured_outputs 'json_object' must be a boolean.", param=param)
    if json_object:
        found.append((param, GrammarSpec("json_object")))
    if len(found) > 1:
        raise bad_request("'structured_outputs' must carry one constraint.", param=param)
    return found


def _spec(kind: GrammarKind, value: Any, *, param: str) -> GrammarSpec:
    """One field's value as a spec; the shape is checked here, compilation by the caller."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise _malformed(param, "a JSON schema (an object or its JSON text)") from None
        if not isinstance(value, dict):
            raise _malformed(param, "a JSON schema (an object or its JSON text)")
        return GrammarSpec(kind, json.dumps(value))
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise _malformed(param, "a non-empty list of strings")
        return GrammarSpec(kind, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise _malformed(param, "a non-empty string")
    return GrammarSpec(kind, value)


def _malformed(param: str, what: str) -> ApiError:
    return bad_request(f"'{param}' must be {what}.", param=param)
