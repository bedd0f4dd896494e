"""Embedding flare in a trio program or test suite: a runtime on the embedded default
model that starts in well under a second, and its HTTP app on a free loopback port.

The pytest fixtures over these (``flare_runtime``, ``flare_server``) live in
``ops.pytest_plugin``; this module imports no test framework, so a script or another
harness can use the same helpers::

    async with open_test_runtime() as runtime, serve_app(runtime) as server:
        ...  # server.url is http://127.0.0.1:PORT

The runtime logs nothing below warnings unless the application configured logging
(``actors.log_defaults``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial

import trio

from actors import Runtime
from actors.config import RuntimeConfig
from app import AppSettings, ConnectionSettings, ServerHandle, create_app, serve_http

START_DEADLINE_S = 60.0
"""Binding the socket takes milliseconds; a minute only bounds a broken start-up."""

LOOPBACK = "127.0.0.1"


def quick_config(**overrides: object) -> RuntimeConfig:
    """A ``RuntimeConfig`` for tests: the embedded default model (``models/default``),
    forwards run op by op (no start-up capture), four request slots and two prefill
    capacities. ``overrides`` replace any field (``model_dir=...``, ``max_context=...``)."""
    base = RuntimeConfig(capture_forward=False, max_batch=4, prefill_capacities=(64, 256))
    return replace(base, **overrides)  # type: ignore[arg-type]


@asynccontextmanager
async def open_test_runtime(config: RuntimeConfig | None = None) -> AsyncIterator[Runtime]:
    """``open_runtime(config or quick_config())``. A test's own deadline covers the
    start-up too: the runtime's nursery cannot open inside a shorter cancel scope."""
    from actors.system import open_runtime  # torch and the model: only when one is opened

    async with open_runtime(config or quick_config()) as runtime:
        yield runtime


@asynccontextmanager
async def serve_app(runtime: Runtime, settings: AppSettings | None = None, *,
                    connections: ConnectionSettings | None = None,
                    host: str = LOOPBACK) -> AsyncIterator[ServerHandle]:
    """Serve ``create_app(runtime, settings)`` on a free port of ``host`` in a nursery
    of its own; on exit, stop admitting, end what is still running and close the
    socket (no grace period: a test's requests are over when its block ends)."""
    app = create_app(runtime, settings)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(START_DEADLINE_S):
            handle: ServerHandle = await nursery.start(partial(
                serve_http, app, host=host, port=0, connections=connections))
        try:
            yield handle
        finally:
            await handle.shutdown(grace_s=0)
            nursery.cancel_scope.cancel()


@dataclass(frozen=True, slots=True)
class FlareServer:
    """A served app, as a client needs it."""

    handle: ServerHandle
    runtime: Runtime

    @property
    def model(self) -> str:
        """The served model name (``--served-model-name`` or the model directory's)."""
        return self.handle.service.model_name

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the base for httpx (``/v1/completions``, ``/metrics``)."""
        return self.handle.url

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``: the ``base_url`` of ``openai.AsyncOpenAI``."""
        return self.handle.url + "/v1"


@asynccontextmanager
async def open_test_server(runtime: Runtime, settings: AppSettings | None = None
                           ) -> AsyncIterator[FlareServer]:
    """``serve_app`` with the addresses and model name a client uses."""
    async with serve_app(runtime, settings) as handle:
        yield FlareServer(handle=handle, runtime=runtime)
