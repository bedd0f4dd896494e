"""The checks on a request body that need no model: what refuses a large body before
any token is encoded (pure: no I/O, no runtime).

``check_body(route, raw, limits, template)`` runs, in the serving path's order, what
``FlareService`` runs on a body before it tokenizes: the bound on JSON values, JSON
decoding (``parse_json_object``), the route's field table and parser, the model name,
and the bound on text length (a completion's string prompts; a chat rendered with its
generation prompt; the text ``/tokenize`` encodes). It raises the ``ApiError`` the
serving path would raise, or returns when the body passes. Everything it needs is in
``BodyLimits``, a picklable value, so ``app.parse_workers`` can run it in another
process; ``FlareService`` uses the same functions for the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from app.chat_template import ChatTemplate, render_within
from app.errors import bad_request, context_too_long
from app.field_table import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    TOKENIZE_FIELDS,
    checked_parse,
)
from app.image_parts import DEFAULT_IMAGE_LIMITS, ImageLimits
from app.request_parsing import (
    MAX_MESSAGES,
    TokenizeParams,
    check_model,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json_object,
    parse_tokenize,
)

JSON_UNITS_PER_MESSAGE = 32
JSON_UNITS_SPARE = 16_384
"""A body may hold ``max_context + JSON_UNITS_PER_MESSAGE * MAX_MESSAGES + JSON_UNITS_SPARE``
JSON strings and values (token ids, messages, fields): parsing holds the GIL, and a body
of a million tiny values would take a quarter of a second to parse."""

COMPLETIONS = "completions"
CHAT = "chat"
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"


@dataclass(frozen=True, slots=True, kw_only=True)
class BodyLimits:
    """What the checks compare a body with: the served model's bounds and names, and
    the chat template's source (compiled again where the checks run)."""

    max_context: int
    max_text_chars: int | None
    """Characters beyond which a text cannot fit the context (``None``: no bound)."""
    model_names: tuple[str, ...]
    image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS
    template_source: str | None = None
    template_origin: str = "the model's chat template"
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def json_units(self) -> int:
        return self.max_context + JSON_UNITS_PER_MESSAGE * MAX_MESSAGES + JSON_UNITS_SPARE

    def template(self) -> ChatTemplate:
        return ChatTemplate(self.template_source, self.special_tokens,
                            origin=self.template_origin)


def json_units(raw: bytes, limit: int) -> int:
    """The strings plus separators (``,`` ``:`` ``[``) outside strings of a JSON body: how
    many values parsing it creates, give or take one. Counted exactly only when a cheap
    over-count exceeds ``limit``; then at most ``limit + 1`` strings are split out."""
    quick = sum(raw.count(c) for c in (b",", b":", b"[", b'"'))
    if quick <= limit:
        return quick
    cleaned = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = cleaned.count(b'"') // 2
    if strings > limit:
        return strings
    outside = cleaned.split(b'"')[::2]
    return strings + sum(p.count(b",") + p.count(b":") + p.count(b"[") for p in outside)


def check_json_units(raw: bytes, limit: int) -> None:
    units = json_units(raw, limit)
    if units > limit:
        raise bad_request(f"The request body holds about {units} JSON values and strings; "
                          f"at most {limit} are accepted.")


def check_prompt_chars(prompt: str, limits: BodyLimits) -> None:
    """A completion prompt longer than the context can hold, refused before encoding."""
    limit = limits.max_text_chars
    if limit is not None and len(prompt) > limit:
        raise context_too_long(
            f"The prompt has {len(prompt)} characters; this model's context of "
            f"{limits.max_context} tokens holds at most {limit} characters of text.",
            param="prompt")


def tokenize_text(template: ChatTemplate, params: TokenizeParams, limits: BodyLimits) -> str:
    """The text ``/tokenize`` encodes when it is one text (a prompt, or messages rendered
    without the generation prompt), refused when longer than the context can hold."""
    tools = params.tools.offered if params.tools else ()
    if params.messages is None:
        assert params.prompt is not None
        text = params.prompt
    else:
        text = template.render(params.messages, add_generation_prompt=False, tools=tools)
    limit = limits.max_text_chars
    if limit is not None and len(text) > limit:
        raise context_too_long(
            f"The text has {len(text)} characters; this model's context of "
            f"{limits.max_context} tokens holds at most {limit} characters.",
            param="prompt" if params.messages is None else "messages")
    return text


def _completion(body: dict[str, Any], limits: BodyLimits, template: ChatTemplate) -> None:
    params, _ = checked_parse(body, COMPLETION_FIELDS, parse_completion)
    check_model(params.common.model, limits.model_names)
    for prompt in params.prompts:
        if isinstance(prompt, str):
            check_prompt_chars(prompt, limits)


def _chat(body: dict[str, Any], limits: BodyLimits, template: ChatTemplate) -> None:
    params, _ = checked_parse(body, CHAT_FIELDS,
                              partial(parse_chat, image_limits=limits.image_limits))
    check_model(params.common.model, limits.model_names)
    render_within(template, params.messages, max_chars=limits.max_text_chars,
                  tools=params.tools.offered if params.tools else ())


def _tokenize(body: dict[str, Any], limits: BodyLimits, template: ChatTemplate) -> None:
    params, _ = checked_parse(body, TOKENIZE_FIELDS, parse_tokenize)
    check_model(params.model, limits.model_names)
    if params.messages is not None and params.add_generation_prompt:
        render_within(template, params.messages, max_chars=limits.max_text_chars,
                      tools=params.tools.offered if params.tools else ())
    else:
        tokenize_text(template, params, limits)


def _detokenize(body: dict[str, Any], limits: BodyLimits, template: ChatTemplate) -> None:
    (model, _), _ = checked_parse(body, DETOKENIZE_FIELDS, parse_detokenize)
    check_model(model, limits.model_names)


ROUTE_CHECKS: dict[str, Callable[[dict[str, Any], BodyLimits, ChatTemplate], None]] = {
    COMPLETIONS: _completion, CHAT: _chat, TOKENIZE: _tokenize, DETOKENIZE: _detokenize}


def check_body(route: str, raw: bytes, limits: BodyLimits, template: ChatTemplate) -> None:
    """Raise the ``ApiError`` that refuses ``raw`` on ``route`` without the model, if any."""
    check_json_units(raw, limits.json_units)
    ROUTE_CHECKS[route](parse_json_object(raw), limits, template)
