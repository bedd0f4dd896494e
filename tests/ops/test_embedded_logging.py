"""An embedded runtime is quiet unless the application configured logging: with
structlog unconfigured, flare's records go through the standard library (warnings and
up by default; per-frame debug traces never reach stdout), while a configured structlog,
as ``flare run`` sets it up, is left exactly as it was."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog
import trio

from actors import GenerationRequest, Runtime, SamplingParams
from actors.log_defaults import quiet_unless_configured
from app import configure_logging
from ops.testing import open_test_runtime, quick_config


@pytest.fixture
def fresh_logging() -> Iterator[None]:
    """structlog and the root logger as a fresh process has them, restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


async def serve_one(runtime: Runtime) -> None:
    request = GenerationRequest(prompt_token_ids=tuple(runtime.codec.encode("x")),
                                max_tokens=3, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0))
    async with runtime.generate(request) as events:
        async for _ in events:
            pass


async def test_unconfigured_embedding_prints_nothing_below_warnings(
        fresh_logging: None, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(60):
        async with open_test_runtime(quick_config(max_context=128)) as runtime:
            await serve_one(runtime)
            structlog.get_logger("flare.planner").warning("lane failed", handle=3)
    out, err = capsys.readouterr()
    assert "scheduler.trace" not in out + err and "runtime ready" not in out + err
    records = [(r.name, r.levelno) for r in caplog.records]
    assert records == [("flare.planner", logging.WARNING)]
    assert "lane failed" in caplog.records[0].getMessage()


async def test_the_application_logging_level_decides(
        fresh_logging: None, caplog: pytest.LogCaptureFixture) -> None:
    """Routed through ``logging``, flare's debug records appear when the application
    asks for them (here pytest's ``caplog`` at debug for the planner)."""
    caplog.set_level(logging.DEBUG, logger="flare.planner")
    with trio.fail_after(60):
        async with open_test_runtime(quick_config(max_context=128)) as runtime:
            await serve_one(runtime)
    traces = [r for r in caplog.records if "scheduler.trace" in r.getMessage()]
    assert traces and all(r.levelno == logging.DEBUG for r in traces)


def test_configured_structlog_is_left_as_flare_run_sets_it(fresh_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("json", level="debug", stream=stream)
    before = structlog.get_config()
    quiet_unless_configured()
    assert structlog.get_config() == before
    structlog.get_logger("flare.planner").debug("scheduler.trace", fence=1)
    assert json.loads(stream.getvalue().splitlines()[-1])["event"] == "scheduler.trace"
