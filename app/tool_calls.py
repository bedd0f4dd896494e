"""Tool calls in the model's output: the constraint for ``required`` and named
``tool_choice``, the parsers that turn output text into calls, and OpenAI's shapes for them
(``message.tool_calls``, and ``delta.tool_calls`` in streams).

Output formats by mode (``app.tool_fields.ToolRequest``):

- ``auto``: the Hermes/Qwen text format the embedded chat template teaches,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, anywhere in the text;
  the rest is content. A block that is not a JSON object with a string ``name`` stays
  content. Streams hold back text that could still become ``<tool_call>`` (as stop strings
  are held back), and the whitespace before it.
- named: the whole output is the function's arguments, constrained by its JSON schema;
  streams send argument fragments as they are generated.
- ``required``: the whole output is a JSON array of ``{"name", "arguments"}`` objects,
  constrained by a schema built from the tools; streams send each call once it is complete.

A call that ends a generation stopped normally finishes with ``tool_calls``. Pure: no I/O;
the only state is each choice's parser.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.openai_format import sse_event
from app.tool_fields import ToolRequest

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
SSE_PREFIX = b"data: "


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str


Piece = Content | CallStart | CallArguments


def _call_pieces(index: int, name: str, arguments: str) -> list[Piece]:
    return [CallStart(index, new_call_id(), name), CallArguments(index, arguments)]


def _decoded_call(text: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one call object's text, or ``None``."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return value["name"], arguments


def _held_suffix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could still start ``marker`` (with the
    whitespace before them)."""
    partial = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1)
                    if marker.startswith(text[-n:])), 0)
    return len(text) - len(text[:len(text) - partial].rstrip())


class HermesParser:
    """``auto``: calls in ``<tool_call>`` blocks, content around them."""

    def __init__(self, *, parallel: bool) -> None:
        self.parallel = parallel
        self.calls = 0
        self._buffer = ""
        self._inside = False
        self._after_call = False
        self._blank = ""  # the whitespace before the open block, content if it is no call

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            marker = TOOL_CALL_CLOSE if self._inside else TOOL_CALL_OPEN
            at = self._buffer.find(marker)
            if at < 0:
                break
            before, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
            if self._inside:
                pieces += self._block(before)
            else:
                pieces += self._content(before.rstrip())
                self._blank = before[len(before.rstrip()):]
            self._inside = not self._inside
        if not self._inside:
            keep = _held_suffix(self._buffer, TOOL_CALL_OPEN)
            pieces += self._content(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
        return pieces

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        if self._inside:  # cut off (or ended) before the closing tag
            return self._block(rest, closed=False)
        return self._content(rest.rstrip() if self._after_call else rest)

    def _content(self, text: str) -> list[Piece]:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return [Content(text)] if text else []

    def _block(self, text: str, *, closed: bool = True) -> list[Piece]:
        call = _decoded_call(text)
        if call is None:
            self._after_call = False
            tail = TOOL_CALL_CLOSE if closed else ""
            return [Content(f"{self._blank}{TOOL_CALL_OPEN}{text}{tail}")]
        self._after_call = True
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls false: only the first call is returned
        self.calls += 1
        return _call_pieces(self.calls - 1, *call)


class NamedParser:
    """Named ``tool_choice``: the whole output is the arguments of ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        if not text:
            return []
        pieces: list[Piece] = []
        if not self.calls:
            self.calls = 1
            pieces.append(CallStart(0, new_call_id(), self.name))
        pieces.append(CallArguments(0, text))
        return pieces

    def finish(self) -> list[Piece]:
        if self.calls:
            return []
        self.calls = 1  # nothing was generated: the call is still the answer, with no text
        return [CallStart(0, new_call_id(), self.name)]


class ArrayParser:
    """``required``: a JSON array of call objects; each is sent once it is complete. Text
    that never became a call (an array cut off by ``max_tokens``, or output that is not
    an array at all) is returned as content rather than dropped."""

    def __init__(self) -> None:
        self.calls = 0
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._start: int | None = None
        self._consumed = 0

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        pieces: list[Piece] = []
        for i in range(self._scanned, len(self._text)):
            c = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if self._depth == 2 and c == "{":
                    self._start = i
            elif c in "]}":
                self._depth -= 1
                if self._depth == 1 and c == "}" and self._start is not None:
                    call = _decoded_call(self._text[self._start:i + 1])
                    if call is not None:
                        pieces += _call_pieces(self.calls, *call)
                        self.calls += 1
                        self._consumed = i + 1
                    self._start = None
        self._scanned = len(self._text)
        return pieces

    def finish(self) -> list[Piece]:
        if not self.calls:
            return [Content(self._text)] if self._text else []
        rest = self._text[self._consumed:].strip().lstrip(",").strip()
        return [Content(rest)] if rest and rest != "]" else []


Parser = HermesParser | NamedParser | ArrayParser


def parser_for(request: ToolRequest) -> Parser | None:
    if request.mode == "auto":
        return HermesParser(parallel=request.parallel)
    if request.mode == "named":
        assert request.function is not None
        return NamedParser(request.function)
    if request.mode == "required":
        return ArrayParser()
    return None


def finish_reason(reason: str | None, parser: Parser) -> str | None:
    return "tool_calls" if reason == "stop" and parser.calls else reason


def apply_to_body(body: dict[str, Any], request: ToolRequest | None) -> dict[str, Any]:
    """A ``chat.completion`` body with each choice's calls moved out of its text."""
    for choice in body["choices"]:
        parser = parser_for(request) if request is not None else None
        if parser is None:
            continue
        message = choice["message"]
        pieces = parser.feed(message.get("content") or "") + parser.finish()
        content = "".join(p.text for p in pieces if isinstance(p, Content))
        calls: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                calls.append({"id": piece.id, "type": "function",
                              "function": {"name": piece.name, "arguments": ""}})
            elif isinstance(piece, CallArguments):
                calls[piece.index]["function"]["arguments"] += piece.text
        message["content"] = None if calls and not content else content
        if calls:
            message["tool_calls"] = calls
        choice["finish_reason"] = finish_reason(choice["finish_reason"], parser)
    return body


def _delta(piece: Piece) -> dict[str, Any]:
    if isinstance(piece, Content):
        return {"content": piece.text}
    if isinstance(piece, CallStart):
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                "function": {"name": piece.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}


@dataclass(slots=True)
class ToolCallStream:
    """Rewrites ``chat.completion.chunk`` bodies: content becomes tool-call deltas."""

    request: ToolRequest
    _parsers: dict[int, Parser | None] = field(default_factory=dict)

    def rewrite(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if not chunk.get("choices"):
            return [chunk]  # usage
        out: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            if choice["index"] not in self._parsers:
                self._parsers[choice["index"]] = parser_for(self.request)
            parser = self._parsers[choice["index"]]
            if parser is None:
                out.append({**chunk, "choices": [choice]})
                continue
            delta = dict(choice["delta"])
            text = delta.pop("content", None) or ""
            pieces = parser.feed(text)
            reason = choice["finish_reason"]
            if reason is not None:
                pieces += parser.finish()
            if not pieces and reason is None:
                if "role" in delta or choice.get("logprobs") is not None:
                    out.append({**chunk, "choices": [{**choice, "delta": choice["delta"]
                                                      if "role" in delta else {}}]})
                continue
            deltas = [_delta(p) for p in pieces]
            if "role" in delta:
                deltas[0:0] = [delta]
            if reason is not None:
                deltas.append({})
            for k, d in enumerate(deltas):
                out.append({**chunk, "choices": [{
                    **choice, "delta": d,
                    "logprobs": choice.get("logprobs") if k == 0 else None,
                    "finish_reason": (finish_reason(reason, parser)
                                      if k == len(deltas) - 1 else None)}]})
        return out


async def tool_call_events(events: AsyncIterator[bytes], request: ToolRequest | None
                           ) -> AsyncIterator[bytes]:
    """A chat SSE body with ``ToolCallStream`` applied to each chunk; error events and
    ``[DONE]`` pass through. Closing it closes ``events``."""
    stream = ToolCallStream(request) if request is not None else None
    try:
        async for event in events:
            payload = (json.loads(event[len(SSE_PREFIX):])
                       if stream is not None and event.startswith(SSE_PREFIX + b"{") else None)
            if stream is None or not isinstance(payload, dict) or "choices" not in payload:
                yield event
                continue
            for chunk in stream.rewrite(payload):
                yield sse_event(chunk)
    finally:
        if isinstance(events, AsyncGenerator):
            await events.aclose()  # its own cleanup (ending the generation) runs now
