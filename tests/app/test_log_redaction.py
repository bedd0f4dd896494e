"""No user content reaches the log: prompts, messages and stop strings never appear in any
record, in either format, including the tracebacks of internal errors (rendered without
local variables, which hold the request's text)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import structlog
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import SseReader, client_for, running_server
from test_http_errors import CHAT, COMPLETIONS, chat, completion
from tokenizers import Tokenizer

from app.log_config import LOG_FORMATS, LogFormat, configure_logging

MARKER = "zq-private-7f3a91"
EXPLODE = "tokenizer-explodes"


@dataclass
class ExplodingCodec(TinyCodec):
    """Fails inside tokenization when the text asks it to: an internal error whose
    frames hold the prompt in their locals."""

    def encode(self, text: str) -> list[int]:
        if EXPLODE in text:
            raise RuntimeError("tokenizer failed")
        return super().encode(text)


@pytest.fixture
def log_output(request: pytest.FixtureRequest) -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    configure_logging(request.param, level="debug", stream=out)
    yield out
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("log_output", LOG_FORMATS, indirect=True)
async def test_request_text_never_reaches_the_log(tokenizer: Tokenizer,
                                                  log_output: io.StringIO) -> None:
    rt = FakeRuntime(ExplodingCodec(tokenizer), crash_after=None)
    text = f"{MARKER} tell me a story"
    messages = [{"role": "system", "content": f"{MARKER} system"},
                {"role": "user", "content": text}]
    with trio.fail_after(30):
        async with running_server(rt) as server, client_for(server) as client:
            served = [
                await client.post(COMPLETIONS, json=completion(prompt=text, stop=[MARKER])),
                await client.post(CHAT, json=chat(messages)),
                await client.post(COMPLETIONS, json=completion(prompt=text, echo=True)),
            ]
            async with client.stream("POST", CHAT, json=chat(messages, stream=True)) as stream:
                assert stream.status_code == 200
                await SseReader(stream).rest()
            refused = [
                await client.post(COMPLETIONS, headers={"Content-Type": "application/json"},
                                  content=json.dumps(completion(prompt=text + "\ud800"))),
                await client.post(COMPLETIONS, json=completion(prompt=text, priority=2)),
                await client.post(COMPLETIONS, json=completion(prompt=text * 200)),
                await client.post(CHAT, json=chat([{"role": "assistant", "content": text}])),
            ]
            failed = [
                await client.post(COMPLETIONS, json=completion(prompt=f"{text} {EXPLODE}")),
                await client.post(CHAT, json=chat([{"role": "user",
                                                    "content": f"{text} {EXPLODE}"}])),
            ]
            rt.crash_after = 1
            crashed = await client.post(COMPLETIONS, json=completion(prompt=text))
    assert [r.status_code for r in served] == [200, 200, 200]
    assert [r.status_code for r in refused] == [400, 400, 400, 400]
    assert [r.status_code for r in failed] == [500, 500]
    assert crashed.status_code == 500
    log = log_output.getvalue()
    # The error paths were logged with their tracebacks...
    assert "http.unhandled_exception" in log and "request.pump_failed" in log
    assert "tokenizer failed" in log and "fake runtime crashed" in log
    assert "request.admitted" in log
    # ...and no user text was.
    assert MARKER not in log
    assert EXPLODE not in log


@pytest.mark.parametrize("fmt", LOG_FORMATS)
def test_stdlib_tracebacks_carry_no_locals(fmt: LogFormat) -> None:
    """hypercorn's error log (stdlib records) renders exceptions the same way."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    try:
        configure_logging(fmt, level="info", stream=out)

        def handle(prompt: str) -> None:
            raise ValueError("application failed")

        try:
            handle(MARKER)
        except ValueError:
            logging.getLogger("hypercorn.error").exception("Error in ASGI Framework")
            structlog.get_logger("flare.app").exception("http.unhandled_exception")
    finally:
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)
    log = out.getvalue()
    assert log.count("application failed") >= 2
    assert MARKER not in log
    if fmt == "json":
        records = [json.loads(line) for line in log.splitlines()]
        assert [r["event"] for r in records] == ["Error in ASGI Framework",
                                                 "http.unhandled_exception"]
        assert all(r["exception"][0]["exc_type"] == "ValueError" for r in records)
