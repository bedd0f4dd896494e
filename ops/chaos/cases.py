"""The bad-input battery: every case is one HTTP request, as bytes on the wire.

Field cases put each value of ``BAD_VALUES`` (booleans, strings, huge numbers, NaN,
lone surrogates...) into each parameter the two POST routes know; structural cases
break the body (empty, not JSON, invalid UTF-8, deep nesting), the parameters'
contents (token ids, messages, stop lists), the content type, the API key, the HTTP
framing (headers, lengths, chunking, methods, paths) and the connection's lifecycle
(HTTP/1.0 and ``Connection: close`` must end with the server closing). ``heavy`` cases
are the maximal bodies (a prompt, a chat and a token list just under the size limit,
and bodies just over it). Values are raw JSON text, so literals Python's ``json``
would never write (``NaN``, ``1e999``, ``"\\ud800"``) reach the server as a client
sent them.

Every base prompt holds ``CANARY``: a server log that shows it shows prompt text.

Each case says what a correct server answers: ``4xx`` (refused), ``2xx`` (served) or
``any`` (either; never a 5xx and never silence, which hold for every case).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

Expect = Literal["2xx", "4xx", "any"]
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    request: bytes
    expect: Expect = "4xx"
    closes: bool = False
    """The server must close the connection once it has answered (HTTP/1.0,
    ``Connection: close``)."""
    heavy: bool = False
    """A maximal body (megabytes on the wire, seconds of server work); ``--quick`` skips."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CaseTarget:
    host: str
    """The ``Host`` header value, ``127.0.0.1:PORT``."""
    api_key: str | None = None
    max_request_bytes: int = 4 * 1024 * 1024


# (label, raw JSON text)
BAD_VALUES: tuple[tuple[str, str], ...] = (
    ("true", "true"), ("false", "false"), ("string", '"7"'), ("negative", "-1"),
    ("fraction", "0.5"), ("huge-int", "1" + "0" * 400), ("huge-float", "1e999"),
    ("nan", "NaN"), ("infinity", "-Infinity"), ("list", "[]"), ("object", "{}"),
    ("surrogate", '"\\ud800"'), ("null", "null"),
)
QUICK_VALUES = ("true", "huge-float", "surrogate")

# What a correct server answers per parameter kind: the labels it may serve ("any");
# every other label must be refused.
_SERVABLE: dict[str, frozenset[str]] = {
    "int": frozenset({"negative", "null"}),
    "number": frozenset({"negative", "fraction", "null"}),
    "bool": frozenset({"true", "false", "null"}),
    "string": frozenset({"string", "null"}),
    "text": frozenset({"string"}),
    "messages": frozenset(),
    "stop": frozenset({"string", "list", "null"}),
    "object": frozenset({"false", "list", "object", "null"}),
}
_COMMON_FIELDS = {
    "max_tokens": "int", "temperature": "number", "top_p": "number", "top_k": "int",
    "seed": "int", "n": "int", "best_of": "int", "presence_penalty": "number",
    "frequency_penalty": "number", "stream": "bool", "stream_options": "object",
    "stop": "stop", "ignore_eos": "bool", "model": "string", "user": "string",
    "logit_bias": "object",
}
FIELDS: dict[str, dict[str, str]] = {
    COMPLETIONS: {"prompt": "text", **_COMMON_FIELDS, "logprobs": "int", "echo": "bool",
                  "suffix": "object"},
    CHAT: {"messages": "messages", **_COMMON_FIELDS, "max_completion_tokens": "int",
           "logprobs": "bool", "top_logprobs": "int", "tools": "object",
           "response_format": "object"},
}
# Both max-token names are set on chat so that no mutation leaves the default (the
# whole context room) in force.
# Every base prompt carries CANARY, so that prompt text in the server's log can be found.
CANARY = "chaoscanary"
BASES: dict[str, dict[str, str]] = {
    COMPLETIONS: {"prompt": f'"def {CANARY}("', "max_tokens": "4"},
    CHAT: {"messages": f'[{{"role": "user", "content": "import {CANARY}"}}]', "max_tokens": "4",
           "max_completion_tokens": "4"},
}
ROUTE_NAMES = {COMPLETIONS: "completions", CHAT: "chat"}


def json_object(fields: dict[str, str]) -> bytes:
    """An object from raw JSON value texts (the values are not re-encoded)."""
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()


def http_request(target: CaseTarget, method: str, path: str, body: bytes = b"", *,
                 content_type: bytes | None = b"application/json",
                 headers: tuple[bytes, ...] = (), version: bytes = b"HTTP/1.1",
                 auth: bool = True, length: bool = True) -> bytes:
    """One request as bytes: request line, Host, the key, type and length, ``headers``."""
    lines = [f"{method} {path} ".encode() + version, b"Host: " + target.host.encode()]
    if auth and target.api_key is not None:
        lines.append(b"Authorization: Bearer " + target.api_key.encode())
    if method == "POST":
        if content_type is not None:
            lines.append(b"Content-Type: " + content_type)
        if length:
            lines.append(b"Content-Length: " + str(len(body)).encode())
    lines.extend(headers)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def field_cases(target: CaseTarget, labels: tuple[str, ...] | None = None) -> list[Case]:
    """Every ``BAD_VALUES`` value in every parameter of both routes."""
    cases = []
    for path, fields in FIELDS.items():
        for field, kind in fields.items():
            for label, raw in BAD_VALUES:
                if labels is not None and label not in labels:
                    continue
                body = json_object({**BASES[path], field: raw})
                expect: Expect = "any" if label in _SERVABLE[kind] else "4xx"
                cases.append(Case(f"{ROUTE_NAMES[path]}/{field}={label}",
                                  http_request(target, "POST", path, body), expect))
    return cases


def _body_cases(target: CaseTarget) -> list[Case]:
    raw_bodies: list[tuple[str, bytes, Expect]] = [
        ("empty body", b"", "4xx"), ("open brace", b"{", "4xx"), ("not json", b"not json", "4xx"),
        ("trailing comma", b'{"max_tokens": 4,}', "4xx"),
        ("invalid utf-8", b'{"prompt": "\xff\xfe", "max_tokens": 4}', "4xx"),
        ("utf-16", '{"prompt": "a", "max_tokens": 4}'.encode("utf-16"), "4xx"),
        ("array", b"[]", "4xx"), ("string", b'"text"', "4xx"), ("null", b"null", "4xx"),
        ("number", b"123", "4xx"), ("empty object", b"{}", "4xx"),
        ("deep nesting", b"[" * 100_000, "4xx"),
        ("giant int literal", b'{"max_tokens": ' + b"9" * 5000 + b"}", "4xx"),
    ]
    cases = []
    for path in (COMPLETIONS, CHAT):
        route = ROUTE_NAMES[path]
        for name, body, expect in raw_bodies:
            cases.append(Case(f"{route}/body: {name}", http_request(target, "POST", path, body),
                              expect))
        base = BASES[path]
        text_field = "prompt" if path == COMPLETIONS else "messages"
        for name, text, expect in (("lone high surrogate", "\\ud800", "4xx"),
                                   ("lone low surrogate", "\\udfff", "4xx"),
                                   ("surrogate inside", f"{CANARY}\\ud800{CANARY}", "4xx"),
                                   ("reversed pair", "\\ude00\\ud83d", "4xx"),
                                   ("valid pair", "\\ud83d\\ude00", "any"),
                                   ("nul character", "a\\u0000b", "any")):
            value = (f'"{text}"' if path == COMPLETIONS
                     else f'[{{"role": "user", "content": "{text}"}}]')
            cases.append(Case(f"{route}/{text_field}: {name}", http_request(
                target, "POST", path, json_object({**base, text_field: value})), expect))
        cases.append(Case(f"{route}/body: duplicate keys", http_request(
            target, "POST", path, json_object(base)[:-1] + b', "max_tokens": 3}'), "any"))
        cases.append(Case(f"{route}/body: utf-8 bom", http_request(
            target, "POST", path, b"\xef\xbb\xbf" + json_object(base)), "any"))
        for name, stop, expect in (("five strings", '["a", "b", "c", "d", "e"]', "4xx"),
                                   ("empty string", '""', "4xx"), ("empty in list", '[""]', "4xx"),
                                   ("number in list", "[1]", "4xx"), ("nested list", "[[]]", "4xx"),
                                   ("null in list", "[null]", "4xx"),
                                   ("surrogate in list", '["\\ud800"]', "4xx"),
                                   ("100k-char string", '"' + "x" * 100_000 + '"', "any")):
            cases.append(Case(f"{route}/stop: {name}", http_request(
                target, "POST", path, json_object({**base, "stop": stop})), expect))
    return cases


def _prompt_and_message_cases(target: CaseTarget) -> list[Case]:
    completion = BASES[COMPLETIONS]
    prompts: list[tuple[str, str, Expect]] = [
        ("surrogate in a list", '["\\ud800"]', "4xx"), ("ids in a list", "[[1, 2, 3]]", "any"),
        ("negative id", "[-1]", "4xx"), ("id outside the vocabulary", "[99999999]", "4xx"),
        ("fractional id", "[0.5]", "4xx"), ("boolean id", "[true]", "4xx"),
        ("empty list", "[]", "4xx"), ("batch of two", '["a", "b"]', "2xx"),
        ("mixed list", '[1, "a"]', "4xx"), ("empty string", '""', "any"),
        ("100k ids", "[" + ", ".join(["1"] * 100_000) + "]", "4xx"),
    ]
    cases = [Case(f"completions/prompt: {name}", http_request(
        target, "POST", COMPLETIONS, json_object({**completion, "prompt": value})), expect)
        for name, value, expect in prompts]
    for name, extra, expect in (("max_tokens 2^31-1", {"max_tokens": str(2**31 - 1)}, "4xx"),
                                ("max_tokens 0", {"max_tokens": "0"}, "4xx"),
                                ("max_tokens 0 with echo", {"max_tokens": "0", "echo": "true"},
                                 "any")):
        request = http_request(target, "POST", COMPLETIONS, json_object({**completion, **extra}))
        cases.append(Case(f"completions/{name}", request, cast(Expect, expect)))
    chat = {k: v for k, v in BASES[CHAT].items() if k != "messages"}
    messages: list[tuple[str, str, Expect]] = [
        ("missing", "null", "4xx"), ("empty list", "[]", "4xx"), ("an object", "{}", "4xx"),
        ("empty message", "[{}]", "4xx"), ("unknown role", '[{"role": "robot", "content": "x"}]',
                                            "4xx"),
        ("surrogate role", '[{"role": "\\ud800", "content": "x"}]', "4xx"),
        ("number content", '[{"role": "user", "content": 123}]', "4xx"),
        ("null content", '[{"role": "user", "content": null}]', "any"),
        ("image part", '[{"role": "user", "content": [{"type": "image_url"}]}]', "4xx"),
        ("part without text", '[{"role": "user", "content": [{"type": "text"}]}]', "4xx"),
        ("part without type", '[{"role": "user", "content": [{"text": "x"}]}]', "4xx"),
        ("number part", '[{"role": "user", "content": [1]}]', "4xx"),
        ("surrogate in a part", '[{"role": "user", "content": [{"type": "text", "text": '
                                '"\\ud800"}]}]', "4xx"),
        ("number name", '[{"role": "user", "content": "x", "name": 5}]', "4xx"),
        ("surrogate name", '[{"role": "user", "content": "x", "name": "\\ud800"}]', "4xx"),
        ("2,049 messages", "[" + ", ".join(['{"role": "user", "content": "hi"}'] * 2049) + "]",
         "4xx"),
        ("2,048 messages", "[" + ", ".join(['{"role": "user", "content": "hi"}'] * 2048) + "]",
         "any"),
    ]
    cases += [Case(f"chat/messages: {name}", http_request(
        target, "POST", CHAT, json_object({"messages": value, **chat})), expect)
        for name, value, expect in messages]
    return cases


def _http_cases(target: CaseTarget) -> list[Case]:
    body = json_object(BASES[COMPLETIONS])
    keyed: Expect = "4xx" if target.api_key is not None else "any"
    post = COMPLETIONS
    auth = [("no key", None), ("wrong key", b"Bearer wrong"), ("basic scheme", b"Basic d3Jvbmc="),
            ("empty bearer", b"Bearer "), ("non-ascii key utf-8", "Bearer clé".encode()),
            ("non-ascii key latin-1", "Bearer clé".encode("latin-1")),
            ("8 KB key", b"Bearer " + b"k" * 8192)]
    cases = [Case(f"auth: {name}", http_request(
        target, "POST", post, body, auth=False,
        headers=() if value is None else (b"Authorization: " + value,)), keyed)
        for name, value in auth]
    for name, ctype, expect in (("text/plain", b"text/plain", "any"),
                                ("form", b"application/x-www-form-urlencoded", "any"),
                                ("multipart", b"multipart/form-data; boundary=x", "any"),
                                ("no content type", None, "any"),
                                ("json utf-8", b"application/json; charset=utf-8", "2xx"),
                                ("json latin-1", b"application/json; charset=latin-1", "any")):
        cases.append(Case(f"content type: {name}",
                          http_request(target, "POST", post, body, content_type=ctype),
                          cast(Expect, expect)))
    for method, path, expect in (("GET", post, "4xx"), ("PUT", post, "4xx"),
                                 ("DELETE", CHAT, "4xx"), ("POST", "/v1/unknown", "4xx"),
                                 ("GET", "/nowhere", "4xx"), ("POST", "/health", "4xx"),
                                 ("OPTIONS", post, "any"), ("GET", "/v1/models", "2xx"),
                                 ("GET", "/health", "2xx"), ("GET", "/metrics", "2xx"),
                                 ("GET", "/v1/models%00", "4xx"),
                                 ("GET", "/" + "a" * 10_000, "4xx")):
        cases.append(Case(f"http: {method} {path[:40]}", http_request(
            target, method, path, body if method == "POST" else b""), cast(Expect, expect)))
    framing: list[tuple[str, bytes, Expect]] = [
        ("20 KB header", http_request(target, "POST", post, body,
                                      headers=(b"X-Pad: " + b"p" * 20_000,)), "any"),
        ("100 KB header", http_request(target, "POST", post, body,
                                       headers=(b"X-Pad: " + b"p" * 100_000,)), "4xx"),
        ("200 headers", http_request(target, "POST", post, body,
                                     headers=tuple(b"X-H%d: v" % i for i in range(200))), "any"),
        ("space in header name", http_request(target, "POST", post, body,
                                              headers=(b"Bad Header: x",)), "4xx"),
        ("control byte in header", http_request(target, "POST", post, body,
                                                headers=(b"X-C: a\x01b",)), "any"),
        ("length not a number", http_request(target, "POST", post, body, length=False,
                                             headers=(b"Content-Length: abc",)), "4xx"),
        ("two lengths", http_request(target, "POST", post, body, headers=(
            b"Content-Length: %d" % (len(body) + 1),)), "4xx"),
        ("chunked", http_request(target, "POST", post, length=False, headers=(
            b"Transfer-Encoding: chunked",)) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
         "2xx"),
        ("bad chunk size", http_request(target, "POST", post, length=False, headers=(
            b"Transfer-Encoding: chunked",)) + b"zz\r\n", "4xx"),
        ("garbage request line", b"GARBAGE\r\n\r\n", "4xx"),
        ("no host", http_request(target, "GET", "/health").replace(
            b"Host: " + target.host.encode() + b"\r\n", b""), "4xx"),
        ("expect 100-continue", http_request(target, "POST", post, body, headers=(
            b"Expect: 100-continue",)), "2xx"),
        ("declared length over the limit", http_request(target, "POST", post, length=False,
                                                        headers=(b"Content-Length: %d" % (
                                                            target.max_request_bytes + 1),)),
         "4xx"),
    ]
    cases += [Case(f"http: {name}", request, expect) for name, request, expect in framing]
    stream = json_object({**BASES[COMPLETIONS], "stream": "true"})
    lifecycle: list[tuple[str, bytes, bytes, tuple[bytes, ...], Expect]] = [
            ("HTTP/1.0", body, b"HTTP/1.0", (), "2xx"),
            ("HTTP/1.0 stream", stream, b"HTTP/1.0", (), "2xx"),
            ("Connection: close", body, b"HTTP/1.1", (b"Connection: close",), "2xx"),
            ("Connection: close stream", stream, b"HTTP/1.1", (b"Connection: close",), "2xx"),
            ("Connection: close on an error", b"{", b"HTTP/1.1", (b"Connection: close",), "4xx")]
    for name, data, version, headers, expect in lifecycle:
        cases.append(Case(f"connection: {name}", http_request(
            target, "POST", post, data, version=version, headers=headers), expect, closes=True))
    return cases


def heavy_cases(target: CaseTarget) -> list[Case]:
    """Bodies at and just over the size limit."""
    limit = target.max_request_bytes
    return [
        Case("maximal: prompt", http_request(target, "POST", COMPLETIONS, maximal_prompt(limit)),
             "4xx", heavy=True),
        Case("maximal: 2,048-message chat", http_request(target, "POST", CHAT,
                                                         maximal_chat(limit)), "4xx", heavy=True),
        Case("maximal: token ids", http_request(target, "POST", COMPLETIONS, maximal_ids(limit)),
             "4xx", heavy=True),
        Case("oversized: body", http_request(target, "POST", COMPLETIONS,
                                             maximal_prompt(limit + 64 * 1024)), "4xx",
             heavy=True),
        Case("oversized: chunked body", http_request(
            target, "POST", COMPLETIONS, length=False, headers=(b"Transfer-Encoding: chunked",))
             + _chunked(maximal_prompt(limit + 64 * 1024)), "4xx", heavy=True),
    ]


def maximal_prompt(limit: int) -> bytes:
    """A completion body of about ``limit`` bytes: one long prompt of words."""
    words = max((limit - 64) // 5, 1)
    return b'{"prompt": "' + b"word " * words + b'", "max_tokens": 1}'


def maximal_chat(limit: int, messages: int = 2048) -> bytes:
    """A chat body of about ``limit`` bytes: ``messages`` messages of equal length (fewer
    when ``limit`` cannot hold that many)."""
    overhead = len(b'{"role": "user", "content": ""}, ')
    messages = max(min(messages, (limit - 64) // (overhead + 1)), 1)
    each = max((limit - 64) // messages - overhead, 1)
    item = b'{"role": "user", "content": "' + b"w" * each + b'"}'
    return b'{"max_tokens": 1, "messages": [' + b", ".join([item] * messages) + b"]}"


def maximal_ids(limit: int) -> bytes:
    """A completion body of about ``limit`` bytes: a prompt of token ids."""
    count = max((limit - 64) // 3, 1)
    return b'{"max_tokens": 1, "prompt": [' + b", ".join([b"1"] * count) + b"]}"


def _chunked(body: bytes, size: int = 64 * 1024) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
             for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def battery(target: CaseTarget, *, quick: bool = False) -> list[Case]:
    """The whole battery (``quick``: a few values per parameter and no maximal bodies)."""
    cases = (field_cases(target, QUICK_VALUES if quick else None) + _body_cases(target)
             + _prompt_and_message_cases(target) + _http_cases(target))
    if not quick:
        cases += heavy_cases(target)
    return cases
