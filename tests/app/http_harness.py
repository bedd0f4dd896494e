"""Start an app on an ephemeral loopback port inside the test's own nursery."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import trio

from actors.public import Runtime
from app import AppSettings, ServerHandle, create_app, serve_http


@asynccontextmanager
async def running_server(runtime: Runtime, settings: AppSettings | None = None
                         ) -> AsyncIterator[ServerHandle]:
    app = create_app(runtime, settings)
    async with trio.open_nursery() as nursery:
        handle: ServerHandle = await nursery.start(partial(serve_http, app, host="127.0.0.1",
                                                           port=0))
        try:
            yield handle
        finally:
            await handle.shutdown(grace_s=0)
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def client_for(handle: ServerHandle, **kwargs: object) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=handle.url, timeout=10.0, **kwargs) as client:  # type: ignore[arg-type]
        yield client
