"""Start an app on an ephemeral loopback port inside the test's own nursery
(``ops.testing.serve_app``, the helper behind the shipped ``flare_server`` fixture)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import trio

from app import ServerHandle
from ops.testing import serve_app as running_server

__all__ = ["SseReader", "client_for", "raw_post", "receive_until", "running_server"]


@asynccontextmanager
async def client_for(handle: ServerHandle, **kwargs: object) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=handle.url, timeout=10.0, **kwargs) as client:  # type: ignore[arg-type]
        yield client


class SseReader:
    """Reads ``data:`` payloads from a streaming httpx response, one at a time."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def next_data(self) -> str:
        async for line in self._lines:
            if line.startswith("data: "):
                return line[len("data: "):]
        raise EOFError("stream ended")

    async def rest(self) -> list[str]:
        items = []
        async for line in self._lines:
            if line.startswith("data: "):
                items.append(line[len("data: "):])
        return items

    async def aclose(self) -> None:
        await self._lines.aclose()  # type: ignore[attr-defined]


async def raw_post(handle: ServerHandle, path: str, body: dict[str, object]) -> trio.SocketStream:
    """Send one POST over a bare socket; the caller reads and, by closing the socket,
    disconnects exactly when it wants (no client library buffering in between)."""
    import json

    stream = await trio.open_tcp_stream("127.0.0.1", handle.port)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    await stream.send_all(head + payload)
    return stream


async def receive_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError(f"connection closed before {marker!r}")
        data += chunk
    return data
