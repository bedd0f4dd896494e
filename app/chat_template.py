"""Chat templating: render messages with the model's jinja template in a sandbox, tokenize,
and compute the message-end token offsets the runtime uses as checkpoint anchors.

Seed: Planning and the execution queue (checkpoint retention uses the exact token
endpoints supplied by the frontend, QUEUE-16..19 / OPEN-23) and system boundaries
(SEL-40 / OPEN-36: flare's system boundary is the end of the leading system messages).

Tokenization is segmented at message ends: the rendered text is cut where each message's
rendering ends and each piece is encoded on its own. The anchors are therefore exact token
offsets, and a later turn of the same conversation reproduces the earlier turn's tokens
bit for bit (so its prefix-cache entry matches). ``TextCodec.encode`` must not add special
tokens by itself; templates place ``bos_token`` explicitly.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from actors import ImagePrompting, TextCodec
from app.errors import bad_request, context_too_long
from app.image_parts import IMAGE_PLACEHOLDER
from app.request_parsing import ChatMessage

# Used when the model ships no template: ChatML, the most widely understood layout.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM_ROLES = ("system", "developer")
# Anchors are computed for the system boundary and the most recent messages only:
# each anchor renders a prefix of the conversation, so anchoring all n messages would cost
# O(n^2). Older turns' boundaries sit at the template's special tokens, which the tokenizer
# splits on anyway, so their tokens stay identical from turn to turn without a cut.
MAX_RECENT_ANCHORS = 32


TEMPLATE_MARKS = ("{{", "{%")
"""A ``--chat-template`` value holding one of these is template text, not a file name."""


class ChatTemplateError(ValueError):
    """Raised at start-up when the model's chat template (or ``--chat-template``) does
    not compile, or names no file and is no template."""


def load_chat_template(value: str) -> str:
    """The template ``--chat-template`` gives: a file's text, or ``value`` itself when it
    is template text (as vLLM reads the flag). It must compile; raises
    ``ChatTemplateError`` naming the flag otherwise."""
    path = pathlib.Path(value)
    if not any(mark in value for mark in TEMPLATE_MARKS):
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise ChatTemplateError(f"--chat-template {value}: not a readable file ({reason}) "
                                    "and not template text") from None
    ChatTemplate(value, {}, origin="--chat-template")  # raises when it does not compile
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizedChat:
    token_ids: tuple[int, ...]
    message_ends: tuple[int, ...]
    system_end: int | None
    image_starts: tuple[int, ...] = ()
    """Where each image placeholder's expansion starts, in order."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (jinja's own escapes ``<`` and ``>``
    and sorts keys), so tool definitions render as they do for ``apply_chat_template``."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message in the shape transformers gives templates: a call's ``arguments`` is the
    decoded object when it is JSON (templates write it with ``tojson``), else the text."""
    item: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        item["name"] = m.name
    if m.tool_calls:
        item["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _decoded(call.arguments)}}
            for call in m.tool_calls]
    if m.tool_call_id is not None:
        item["tool_call_id"] = m.tool_call_id
    return item


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ChatTemplate:
    """One compiled template; ``render`` is synchronous and side-effect free."""

    def __init__(self, source: str | None, special_tokens: dict[str, str], *,
                 origin: str = "the model's chat template") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self.source = source if source is not None else FALLBACK_CHAT_TEMPLATE
        self.uses_fallback = source is None
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{origin} does not compile: {exc}") from exc
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool,
               tools: Sequence[dict[str, Any]] = ()) -> str:
        """``tools``: the offered tool definitions (OpenAI's shape), passed to the template
        as ``tools`` when there are any, as ``apply_chat_template`` does."""
        variables = {**self._special_tokens, "messages": [_template_message(m) for m in messages],
                     "add_generation_prompt": add_generation_prompt}
        if tools:
            variables["tools"] = list(tools)
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise bad_request(f"The chat template rejected these messages: {exc}",
                              param="messages") from None
        except Exception as exc:  # a template tripping over unusual content is still bad input
            raise bad_request(f"The chat template could not render these messages: "
                              f"{type(exc).__name__}: {exc}", param="messages") from None


def _message_boundaries(template: ChatTemplate, messages: Sequence[ChatMessage],
                        full_text: str, tools: Sequence[dict[str, Any]]
                        ) -> list[tuple[int, int]]:
    """(message index, character offset) where each message's rendering ends, when the
    rendering of the conversation up to it is a prefix of the full rendering."""
    boundaries: list[tuple[int, int]] = []
    last = 0
    leading_system = _leading_system_count(messages)
    recent = max(0, len(messages) - MAX_RECENT_ANCHORS)
    for k in range(len(messages)):
        if k != leading_system - 1 and k < recent:
            continue
        prefix = template.render(messages[: k + 1], add_generation_prompt=False, tools=tools)
        if len(prefix) > last and full_text.startswith(prefix):
            boundaries.append((k, len(prefix)))
            last = len(prefix)
    return boundaries


def _leading_system_count(messages: Sequence[ChatMessage]) -> int:
    count = 0
    while count < len(messages) and messages[count].role in SYSTEM_ROLES:
        count += 1
    return count


def render_within(template: ChatTemplate, messages: Sequence[ChatMessage], *,
                  max_chars: int | None, tools: Sequence[dict[str, Any]] = ()) -> str:
    """The conversation rendered with a generation prompt, refused (context length) when
    longer than ``max_chars`` characters."""
    full_text = template.render(messages, add_generation_prompt=True, tools=tools)
    if max_chars is not None and len(full_text) > max_chars:
        raise context_too_long(
            f"The rendered conversation has {len(full_text)} characters; this model's "
            f"context holds at most {max_chars} characters of text.")
    return full_text
def _encoder(codec: TextCodec, image: ImagePrompting | None, starts: list[int]
             ) -> Callable[[str, int], list[int]]:
    """``encode(text, offset)``: the text's ids; with ``image``, each
    ``IMAGE_PLACEHOLDER`` becomes ``tokens_per_image`` image ids (as LLaVA's processor
    expands it) and its start (``offset`` + its index) is appended to ``starts``."""
    if image is None:
        return lambda text, offset: codec.encode(text)

    def encode(text: str, offset: int) -> list[int]:
        pieces = text.split(IMAGE_PLACEHOLDER)
        ids = codec.encode(pieces[0]) if pieces[0] else []
        for piece in pieces[1:]:
            starts.append(offset + len(ids))
            ids += [image.image_token_id] * image.tokens_per_image
            ids += codec.encode(piece) if piece else []
        return ids
    return encode


def tokenize_chat(template: ChatTemplate, codec: TextCodec, messages: Sequence[ChatMessage],
                  *, max_chars: int | None = None,
                  tools: Sequence[dict[str, Any]] = (),
                  image: ImagePrompting | None = None) -> TokenizedChat:
    """Render with a generation prompt (and the offered ``tools``), tokenize segment by
    segment, and locate anchors; with ``image``, image placeholders expand to image ids.

    A rendering longer than ``max_chars`` characters (text that cannot fit the context)
    is refused before any anchor is rendered or any text encoded."""
    full_text = render_within(template, messages, max_chars=max_chars, tools=tools)
    boundaries = _message_boundaries(template, messages, full_text, tools)
    token_ids: list[int] = []
    message_ends: list[int] = []
    system_end: int | None = None
    leading_system = _leading_system_count(messages)
    start = 0
    image_starts: list[int] = []
    encode = _encoder(codec, image, image_starts)
    for index, end in boundaries:
        token_ids.extend(encode(full_text[start:end], len(token_ids)))
        start = end
        if message_ends and message_ends[-1] == len(token_ids):
            continue
        message_ends.append(len(token_ids))
        if index == leading_system - 1:
            system_end = len(token_ids)
    if start < len(full_text):
        token_ids.extend(encode(full_text[start:], len(token_ids)))
    return TokenizedChat(token_ids=tuple(token_ids), message_ends=tuple(message_ends),
                         system_end=system_end, image_starts=tuple(image_starts))
