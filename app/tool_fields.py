"""Parse and validate the tool-calling fields of a chat request (pure: no I/O, no runtime).

``tools``, ``tool_choice`` and ``parallel_tool_calls`` become one ``ToolRequest``; an
assistant message's ``tool_calls`` and a tool message's ``tool_call_id`` become fields of
``ChatMessage``. Every mistake is a 400 naming the field (``tools``, ``tool_choice``,
``parallel_tool_calls`` or ``messages``). The legacy ``functions`` / ``function_call``
fields are refused: send ``tools``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from actors import GrammarSpec, grammar_problem
from app.errors import bad_request

ToolMode = Literal["none", "auto", "required", "named"]
MAX_TOOLS = 128
# OpenAI's rule for function names; it also keeps names safe inside the tool-call text.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The JSON-schema keywords whose value must itself be a schema (object or boolean).
_SCHEMA_VALUED = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "additionalItems", "unevaluatedProperties",
                  "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True, kw_only=True)
class FunctionTool:
    """One ``{"type": "function", "function": {...}}`` entry of ``tools``."""

    name: str
    parameters: dict[str, Any]
    """The arguments' JSON schema (``EMPTY_PARAMETERS`` when the tool sent none)."""
    definition: dict[str, Any]
    """The entry as the client sent it, for the chat template."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolRequest:
    """What the request asks of tools. ``mode`` ``none`` offers no tools to the model;
    ``auto`` offers them and parses calls from the output; ``required`` and ``named``
    constrain the output to calls (``named``: to ``function``)."""

    tools: tuple[FunctionTool, ...]
    mode: ToolMode
    function: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> tuple[dict[str, Any], ...]:
        """The tool definitions shown to the model in the prompt (none for ``none``)."""
        return () if self.mode == "none" else tuple(t.definition for t in self.tools)

    def tool(self, name: str) -> FunctionTool:
        return next(t for t in self.tools if t.name == name)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallRecord:
    """A call in an assistant message of the history; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


def parse_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The tool fields of a chat body; ``None`` when it uses none of them."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_request(f"'{legacy}' is not supported; send 'tools' and 'tool_choice' "
                              "instead.", param=legacy)
    raw_tools = body.get("tools")
    raw_choice = body.get("tool_choice")
    raw_parallel = body.get("parallel_tool_calls")
    if raw_tools is None and raw_choice is None and raw_parallel is None:
        return None
    tools = _tools(raw_tools)
    if raw_parallel is not None and not isinstance(raw_parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    mode, function = _choice(raw_choice, tools)
    return ToolRequest(tools=tools, mode=mode, function=function,
                       parallel=True if raw_parallel is None else raw_parallel)


def constraint_schema(request: ToolRequest) -> dict[str, Any] | None:
    """The JSON schema the output must follow, or ``None`` when it is free (``auto``)."""
    if request.mode == "named":
        assert request.function is not None
        return request.tool(request.function).parameters
    if request.mode != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.name]},
                             "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in request.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not request.parallel:
        schema["maxItems"] = 1
    return schema


def tool_grammar(request: ToolRequest | None, grammar: GrammarSpec | None
                 ) -> GrammarSpec | None:
    """The request's output constraint: ``grammar`` (from ``response_format`` or a guided
    field), or tool calls when ``tool_choice`` is ``required`` or names a function (a 400
    if both constrain it, or if the tools' schemas do not compile)."""
    schema = None if request is None else constraint_schema(request)
    if schema is None:
        return grammar
    if grammar is not None:
        raise bad_request("'tool_choice' \"required\" or a named function constrains the "
                          "output to tool calls; it cannot be combined with "
                          "'response_format' or a guided_* field.", param="tool_choice")
    spec = GrammarSpec("json_schema", json.dumps(schema))
    problem = grammar_problem(spec)
    if problem is not None:
        raise bad_request(f"The tools' parameter schemas do not compile: {problem}",
                          param="tools")
    return spec


def _tools(raw: Any) -> tuple[FunctionTool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of function tools.", param="tools")
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' holds {len(raw)} tools; at most {MAX_TOOLS} are accepted.",
                          param="tools")
    tools: list[FunctionTool] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or item.get("type") != "function":
            raise bad_request(f"tools[{i}] must be an object with \"type\": \"function\".",
                              param="tools")
        function = item.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"tools[{i}].function must be an object.", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' "
                              "or '-'.", param="tools")
        if any(t.name == name for t in tools):
            raise bad_request(f"tools[{i}]: the function name '{name}' appears twice.",
                              param="tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"tools[{i}].function.description must be a string.",
                              param="tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        problem = schema_problem(parameters)
        if problem is None and (not isinstance(parameters, dict)
                                or parameters.get("type", "object") != "object"):
            problem = "the arguments must be an object (\"type\": \"object\")"
        if problem is not None:
            raise bad_request(f"tools[{i}].function.parameters is not a valid JSON schema: "
                              f"{problem}.", param="tools")
        tools.append(FunctionTool(name=name, parameters=parameters, definition=item))
    return tuple(tools)


def schema_problem(schema: Any) -> str | None:
    """What makes ``schema`` malformed as a JSON schema, or ``None``. A structural check
    of the keywords that hold schemas, types and requirement lists (iterative, so a deep
    schema cannot exhaust the stack); the constrained decoder compiles it in full."""
    stack: list[tuple[str, Any]] = [("parameters", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"{path} must be an object"
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if kind is not None and not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds):
            return f"{path}.type must be one of {', '.join(_JSON_TYPES)} (or a list of them)"
        required = node.get("required")
        if required is not None and not (isinstance(required, list)
                                         and all(isinstance(r, str) for r in required)):
            return f"{path}.required must be a list of strings"
        enum = node.get("enum")
        if enum is not None and not isinstance(enum, list):
            return f"{path}.enum must be a list"
        for key in _SCHEMA_VALUED:
            if key in node:
                stack.append((f"{path}.{key}", node[key]))
        for key in _SCHEMA_MAPS:
            if key in node:
                if not isinstance(node[key], dict):
                    return f"{path}.{key} must be an object"
                stack.extend((f"{path}.{key}.{k}", v) for k, v in node[key].items())
        for key in _SCHEMA_LISTS:
            if key in node:
                if not isinstance(node[key], list) or not node[key]:
                    return f"{path}.{key} must be a non-empty list"
                stack.extend((f"{path}.{key}[{j}]", v) for j, v in enumerate(node[key]))
    return None


def _choice(raw: Any, tools: tuple[FunctionTool, ...]) -> tuple[ToolMode, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw in ("none", "auto"):
        return ("auto" if raw == "auto" and tools else "none"), None  # no tools: nothing to call
    if raw == "required":
        if not tools:
            raise bad_request("'tool_choice' \"required\" needs at least one tool in 'tools'.",
                              param="tool_choice")
        return "required", None
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request("'tool_choice' must name a function: {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}.", param="tool_choice")
        if not any(t.name == name for t in tools):
            raise bad_request(f"'tool_choice' names the function '{name[:64]}', which is not "
                              "in 'tools'.", param="tool_choice")
        return "named", name
    raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                      param="tool_choice")


def parse_message_tool_fields(item: dict[str, Any], index: int
                              ) -> tuple[tuple[ToolCallRecord, ...], str | None]:
    """An assistant message's ``tool_calls`` and a tool message's ``tool_call_id``."""
    tool_call_id = item.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise bad_request(f"messages[{index}].tool_call_id must be a string.", param="messages")
    raw = item.get("tool_calls")
    if raw is None:
        return (), tool_call_id
    if item.get("role") != "assistant":
        raise bad_request(f"messages[{index}]: only assistant messages carry 'tool_calls'.",
                          param="messages")
    if not isinstance(raw, list):
        raise bad_request(f"messages[{index}].tool_calls must be a list.", param="messages")
    calls: list[ToolCallRecord] = []
    for j, call in enumerate(raw):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}.", param="messages")
        name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.function.name must be a non-empty string.",
                              param="messages")
        if isinstance(arguments, dict):  # some clients send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise bad_request(f"{where}.function.arguments must be a JSON string.",
                              param="messages")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{where}.id must be a string.", param="messages")
        calls.append(ToolCallRecord(id=call_id or "", name=name, arguments=arguments))
    return tuple(calls), tool_call_id
