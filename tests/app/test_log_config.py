"""structlog configuration: JSON lines carry the documented common fields, and stdlib
records (hypercorn) come out in the same format."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from app.log_config import configure_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_format_writes_one_object_per_line(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("json", level="info", stream=out)
    structlog.get_logger("flare.app.requests").info("request.finished", request_id="cmpl-1",
                                                    completion_tokens=3)
    structlog.get_logger("flare.app").debug("hidden")
    logging.getLogger("hypercorn.error").warning("Running on %s", "http://x")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["event"] == "request.finished" and first["completion_tokens"] == 3
    assert first["level"] == "info" and first["logger"] == "flare.app.requests"
    assert first["timestamp"].endswith("Z")
    assert second == {**second, "event": "Running on http://x", "level": "warning",
                      "logger": "hypercorn.error"}


def test_console_format_and_bad_values(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("console", level="warning", stream=out)
    structlog.get_logger("flare.app").warning("server.draining", in_flight=2)
    assert "server.draining" in out.getvalue() and "in_flight=2" in out.getvalue()
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml", stream=out)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="log level"):
        configure_logging("json", level="loud", stream=out)
