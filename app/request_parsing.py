"""Parse and validate OpenAI request bodies into frozen values (pure: no I/O, no runtime).

Everything a client can get wrong about the *shape* of a request is decided here and
raised as a 400 ``ApiError`` naming the parameter; nothing malformed reaches the
runtime. Which fields a route accepts at all (unknown, ignored and refused ones) is
``app/field_table.py``'s decision, applied before these parsers run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from actors import TOP_LOGPROBS, GrammarSpec, SamplingParams
from app.completion_prompts import Prompt, parse_prompts
from app.errors import bad_request, model_not_found
from app.image_parts import (
    DEFAULT_IMAGE_LIMITS,
    IMAGE_PLACEHOLDER,
    ImageInput,
    ImageLimits,
    parse_image_part,
)
from app.sampling_fields import parse_sampling_fields
from app.structured_fields import structured_output_of
from app.tool_fields import (
    ToolCallRecord,
    ToolRequest,
    parse_message_tool_fields,
    parse_tool_request,
    tool_grammar,
)

MAX_STOP_STRINGS = 4
# Each message adds template work (anchors render prefixes); this bounds a single request's
# CPU cost far above any real conversation.
MAX_MESSAGES = 2048
MAX_SEED = 2**63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_REQUEST_ID_CHARS = 128
MAX_CHOICES = 128
"""Choices one request may ask for (``n`` times the prompts): each is a runtime request."""
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


@dataclass(frozen=True, slots=True, kw_only=True)
class CommonParams:
    """Parameters shared by completions and chat completions."""

    model: str | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    user: str
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
    n: int = 1
    grammar: GrammarSpec | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionParams:
    common: CommonParams
    prompt: Prompt
    """The first prompt; the route serves each of ``prompts`` with ``prompt`` set to it."""
    echo: bool
    logprobs: bool
    batch: tuple[Prompt, ...] = ()
    """Every prompt of a batch (empty: just ``prompt``)."""

    @property
    def prompts(self) -> tuple[Prompt, ...]:
        return self.batch or (self.prompt,)
    top_logprobs: int = 0
    """``logprobs: k``: the k most likely alternatives per token (0: none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCallRecord, ...] = ()
    tool_call_id: str | None = None
    images: tuple[ImageInput, ...] = ()
    """This message's images, in order (its content holds one placeholder each)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatParams:
    common: CommonParams
    messages: tuple[ChatMessage, ...]
    logprobs: bool
    top_logprobs: int = 0
    tools: ToolRequest | None = None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8.") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """Refuse any string in the body that is not valid Unicode.

    JSON's ``\\ud800`` escapes decode to lone surrogates, which no UTF-8 consumer (the
    tokenizer, the logs, the response) can encode. Every string (keys and values, known
    fields or not) is checked once here, iteratively (no recursion limit), so nothing
    past parsing ever sees one. ``param`` is the top-level field that holds it.
    """
    stack: list[tuple[str | None, str, Any]] = [(None, "", body)]
    while stack:
        param, path, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                where = f"'{path[:200]}'" if path else "the request body"
                raise bad_request(f"{where} is not valid Unicode (it holds a lone UTF-16 "
                                  "surrogate).", param=param)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    where = f"an object key in '{path[:200]}'" if path else "a field name"
                    raise bad_request(f"{where} is not valid Unicode (it holds a lone UTF-16 "
                                      "surrogate).", param=param)
                stack.append((param or key, f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((param, f"{path}[{i}]", item) for i, item in enumerate(value))


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Fields:
    """Typed accessors over one JSON object; each failure names the parameter."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def present(self, name: str) -> bool:
        return self.body.get(name) is not None

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be a boolean.", param=name)
        return value

    def integer(self, name: str, *, lo: int, hi: int) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"'{name}' must be an integer.", param=name)
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_request(f"'{name}' must be an integer.", param=name)
            value = int(value)
        if not lo <= value <= hi:
            raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}.", param=name)
        return value

    def number(self, name: str, *, lo: float, hi: float, default: float,
               lo_open: bool = False) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"'{name}' must be a number.", param=name)
        try:
            number = float(value)
        except OverflowError:  # an integer literal too large for a float
            number = math.inf
        if not math.isfinite(number) or number > hi or number < lo or (lo_open and number == lo):
            bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise bad_request(f"'{name}' must be within {bound}, got {value}.", param=name)
        return number

    def string(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise bad_request(f"'{name}' must be a string.", param=name)
        return value

    def refuse_unless(self, name: str, allowed: int, why: str, *, integer: bool) -> None:
        """A numeric parameter we accept only at its neutral value ``allowed``."""
        value = self.body.get(name)
        if value is None:
            return
        kind = "an integer" if integer else "a number"
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or (integer and isinstance(value, float) and not value.is_integer())):
            raise bad_request(f"'{name}' must be {kind}.", param=name)
        if value != allowed:
            raise bad_request(f"'{name}'={json.dumps(value)[:80]} is not supported: {why}",
                              param=name)


def _common(fields: _Fields, *, max_tokens_names: tuple[str, ...]) -> CommonParams:
    model = fields.string("model")
    n = fields.integer("n", lo=1, hi=MAX_CHOICES) or 1
    best_of = fields.integer("best_of", lo=1, hi=MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise bad_request(f"'best_of'={best_of} is not supported: only best_of equal to n "
                          f"(here {n}) is served (every generated choice is returned).",
                          param="best_of")
    max_tokens = None
    for name in max_tokens_names:
        value = fields.integer(name, lo=0, hi=2**31 - 1)
        if value is not None and max_tokens is not None and value != max_tokens:
            raise bad_request(f"'{name}'={value} differs from '{max_tokens_names[0]}'="
                              f"{max_tokens}; send one of them (or the same value in both).",
                              param=name)
        if value is not None:
            max_tokens = value
    temperature = fields.number("temperature", lo=0.0, hi=2.0, default=1.0)
    top_p = fields.number("top_p", lo=0.0, hi=1.0, default=1.0, lo_open=True)
    top_k = fields.integer("top_k", lo=-1, hi=2**31 - 1)
    seed = fields.integer("seed", lo=-MAX_SEED - 1, hi=MAX_SEED)
    stream = fields.boolean("stream", False)
    include_usage = continuous_usage = False
    options = fields.body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                              param="stream_options")
        unknown = next((k for k in options if k not in STREAM_OPTIONS), None)
        if unknown is not None:
            raise bad_request(f"Unknown field 'stream_options.{unknown[:80]}'; known: "
                              f"{', '.join(STREAM_OPTIONS)}.", param="stream_options")
        include_usage = _Fields(options).boolean("include_usage", False)
        continuous_usage = _Fields(options).boolean("continuous_usage_stats", False)
    user = fields.string("user") or ""
    return CommonParams(
        model=model,
        max_tokens=max_tokens,
        sampling=SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=max(0, top_k or 0),  # OpenAI-style -1 and 0 both mean "no top-k"
            seed=seed,
            **parse_sampling_fields(fields.body),
        ),
        stop=_stop_strings(fields.body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        ignore_eos=fields.boolean("ignore_eos", False),
        user=user,
        n=n,
        grammar=structured_output_of(fields.body),
    )


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings.", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' accepts at most {MAX_STOP_STRINGS} strings.", param="stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' strings must not be empty.", param="stop")
    return tuple(stops)


def parse_completion(body: dict[str, Any]) -> CompletionParams:
    """``POST /v1/completions``: one prompt or a batch (``app.completion_prompts``)."""
    fields = _Fields(body)
    common = _common(fields, max_tokens_names=("max_tokens",))
    batch = parse_prompts(body.get("prompt"))
    if len(batch) * common.n > MAX_CHOICES:
        raise bad_request(f"{len(batch)} prompts times n={common.n} ask for more than "
                          f"{MAX_CHOICES} choices.", param="n")
    logprobs = fields.integer("logprobs", lo=0, hi=TOP_LOGPROBS)
    echo = fields.boolean("echo", False)
    if common.max_tokens == 0 and not echo:
        raise bad_request("'max_tokens' must be at least 1 (0 is allowed only with echo).",
                          param="max_tokens")
    return CompletionParams(common=common, prompt=batch[0], batch=batch, echo=echo,
                            logprobs=logprobs is not None, top_logprobs=logprobs or 0)


def _message_content(value: Any, index: int, images: list[ImageInput],
                     limits: ImageLimits) -> str:
    """The text of ``messages[index].content``; image parts (``app.image_parts``) are
    appended to ``images`` and stand as ``IMAGE_PLACEHOLDER`` in the text."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts: list[str] = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"messages[{index}].content parts must be objects with a "
                                  "'type'.", param="messages")
            if part["type"] == "image_url":
                field = f"messages[{index}].content[{j}].image_url"
                images.append(parse_image_part(part, field, limits, len(images)))
                parts.append(IMAGE_PLACEHOLDER)
                continue
            if part["type"] != "text":
                raise bad_request(f"messages[{index}]: content of type '{part['type']}' is not "
                                  "supported (text and image_url only).", param="messages")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}]: a text part needs a string 'text'.",
                                  param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text and "
                      "image_url parts.", param="messages")


def parse_chat(body: dict[str, Any], image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> ChatParams:
    """``POST /v1/chat/completions``."""
    fields = _Fields(body)
    tools = parse_tool_request(body)
    common = _common(fields, max_tokens_names=("max_tokens", "max_completion_tokens"))
    common = replace(common, grammar=tool_grammar(tools, common.grammar))
    if common.max_tokens == 0:
        raise bad_request("'max_tokens' must be at least 1.", param="max_tokens")
    messages = _messages(body.get("messages"), image_limits)
    top_logprobs = fields.integer("top_logprobs", lo=0, hi=TOP_LOGPROBS)
    logprobs = fields.boolean("logprobs", False)
    if top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return ChatParams(common=common, messages=messages, logprobs=logprobs,
                      top_logprobs=top_logprobs or 0, tools=tools)


def _messages(raw: Any, image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> tuple[ChatMessage, ...]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    if len(raw) > MAX_MESSAGES:
        raise bad_request(f"'messages' holds {len(raw)} messages; at most {MAX_MESSAGES} are "
                          "accepted.", param="messages")
    messages: list[ChatMessage] = []
    images: list[ImageInput] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"messages[{i}] must be an object.", param="messages")
        role = item.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}.",
                              param="messages")
        name = item.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"messages[{i}].name must be a string.", param="messages")
        tool_calls, tool_call_id = parse_message_tool_fields(item, i)
        before = len(images)
        content = _message_content(item.get("content"), i, images, image_limits)
        messages.append(ChatMessage(role=role, content=content, name=name, tool_calls=tool_calls,
                                    tool_call_id=tool_call_id, images=tuple(images[before:])))
    return tuple(messages)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeParams:
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model: str | None
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    add_generation_prompt: bool
    tools: ToolRequest | None = None


def parse_tokenize(body: dict[str, Any]) -> TokenizeParams:
    fields = _Fields(body)
    model = fields.string("model")
    if fields.present("messages"):
        if fields.present("prompt"):
            raise bad_request("Send either 'prompt' or 'messages', not both.", param="prompt")
        return TokenizeParams(model=model, prompt=None, messages=_messages(body["messages"]),
                              add_generation_prompt=fields.boolean("add_generation_prompt",
                                                                   True),
                              tools=parse_tool_request(body))
    prompt = fields.string("prompt")
    if prompt is None:
        raise bad_request("'prompt' (a string) or 'messages' is required.", param="prompt")
    return TokenizeParams(model=model, prompt=prompt, messages=None,
                          add_generation_prompt=False)


def parse_detokenize(body: dict[str, Any]) -> tuple[str | None, tuple[int, ...]]:
    """``POST /detokenize``: the model name (if sent) and the token ids."""
    fields = _Fields(body)
    model = fields.string("model")
    raw = body.get("tokens")
    if not isinstance(raw, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise bad_request("'tokens' must be a list of token ids.", param="tokens")
    if any(t < 0 for t in raw):
        raise bad_request("Token ids in 'tokens' must be non-negative.", param="tokens")
    return model, tuple(raw)


def check_model(requested: str | None, served: str | tuple[str, ...]) -> None:
    """An omitted model means the served one; a name not ``served`` is unknown (404)."""
    names = (served,) if isinstance(served, str) else served
    if requested is not None and requested not in names:
        raise model_not_found(requested)



def parse_request_id(value: str | None) -> str | None:
    """An ``X-Request-Id`` header a client sent: printable ASCII, at most
    ``MAX_REQUEST_ID_CHARS`` characters (it is logged and echoed verbatim)."""
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_CHARS:
        raise bad_request(f"'X-Request-Id' must be 1 to {MAX_REQUEST_ID_CHARS} characters, got "
                          f"{len(value)}.", param="X-Request-Id")
    if not (value.isascii() and value.isprintable()):
        raise bad_request("'X-Request-Id' must be printable ASCII.", param="X-Request-Id")
    return value
