"""Connection lifecycle for the HTTP server: closing per HTTP semantics, keep-alive and
write timeouts, and a bound on open connections (docs/reliability.md, "Connection
handling").

Two pieces sit around hypercorn's trio worker:

``ResponseEndShield`` (ASGI middleware) makes the application's last ``send`` of a
response un-cancellable. Hypercorn does its per-connection bookkeeping inside that call:
after the final body chunk it closes the connection (``Connection: close``, HTTP/1.0) or
arms the keep-alive timer, and on the way it queues ``http.disconnect`` for the
application. quart-trio answers that message by cancelling the request's nursery, which
is the task still inside hypercorn's bookkeeping, so the close or the timer never
happened and every used connection stayed open. Shielding that one call lets hypercorn
finish it; the cancellation still lands right after.

``BoundedTCPServer`` is hypercorn's ``TCPServer`` with three additions, active only
when the config is a ``FlareConfig``: each socket write must complete within
``write_timeout`` seconds (hypercorn shields its writes, so a client that stops reading
would otherwise hold the connection, the request and its buffered output forever; on
expiry the socket is closed and the application sees a disconnect, which cancels the
generation); at most ``max_connections`` connections are served at once (beyond that a
connection gets a 503 JSON answer with ``Retry-After`` and is closed); and a connection
ends as soon as its client closes it, where hypercorn would keep the socket until the
keep-alive timer expired. hypercorn 0.18 has no per-send timeout and no connection bound
(``backlog`` only sizes the kernel's accept queue), and its trio worker builds
``TCPServer`` from a module global, so ``install_bounded_tcp_server`` points that global
at the subclass; with a plain ``Config`` the subclass behaves exactly like hypercorn's.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

import structlog
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, Scope

log = structlog.get_logger("flare.app.connections")

DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 512
# A refused connection gets this long to take its 503 and close its side; its unread
# request bytes are drained meanwhile so that closing does not reset the answer away.
REFUSAL_LINGER_S = 1.0
REFUSAL_DRAIN_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """How long connections may idle or stall, and how many may be open at once."""

    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    """An idle connection (before its first request or between requests) is closed after
    this many seconds."""
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    """A write the client does not take within this many seconds closes the connection;
    its request is cancelled as on a disconnect."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Connections served at once; beyond it a new connection is answered 503 and closed."""


class ConnectionBound:
    """Counts open connections against a limit (one trio thread, so plain counters)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.refused = 0

    def try_enter(self) -> bool:
        if self.open >= self.limit:
            self.refused += 1
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1


class FlareConfig(Config):
    """A hypercorn ``Config`` that also carries the write timeout and connection bound
    ``BoundedTCPServer`` applies."""

    write_timeout: float | None = None
    connection_bound: ConnectionBound | None = None


def hypercorn_config(settings: ConnectionSettings) -> FlareConfig:
    config = FlareConfig()
    config.keep_alive_timeout = settings.keep_alive_timeout_s
    config.write_timeout = settings.write_timeout_s
    config.connection_bound = ConnectionBound(settings.max_connections)
    return config


def _refusal() -> bytes:
    body = json.dumps({"error": {
        "message": "The server has too many open connections; retry shortly.",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


REFUSAL = _refusal()


async def _refuse(stream: trio.abc.Stream) -> None:
    """Answer 503 without reading the request, close our side, drain what the client
    sent (bounded in time and bytes), close."""
    with trio.move_on_after(REFUSAL_LINGER_S):
        try:
            await stream.send_all(REFUSAL)
            if isinstance(stream, trio.abc.HalfCloseableStream):
                await stream.send_eof()
            drained = 0
            while drained < REFUSAL_DRAIN_BYTES:
                chunk = await stream.receive_some(REFUSAL_DRAIN_BYTES)
                if not chunk:
                    break
                drained += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


class BoundedTCPServer(TCPServer):
    """hypercorn's ``TCPServer`` plus the write timeout and the connection bound of a
    ``FlareConfig`` (see the module docstring)."""

    # Set once reading has ended or the socket was closed for a stalled write: from then
    # on the connection only winds down and never re-arms its keep-alive timer.
    _socket_gone = False

    async def run(self) -> None:
        bound: ConnectionBound | None = getattr(self.config, "connection_bound", None)
        if bound is None:
            await super().run()
            return
        if not bound.try_enter():
            log.info("connection.refused", open=bound.open, limit=bound.limit)
            await _refuse(self.stream)
            return
        try:
            await super().run()
        finally:
            bound.leave()

    async def _read_data(self) -> None:
        await super()._read_data()
        if isinstance(self.config, FlareConfig):
            # The client closed (or the socket broke): stop the keep-alive timer so the
            # connection ends now instead of holding its socket until the timer expires.
            self._socket_gone = True
            await self.idle_task.stop()

    async def protocol_send(self, event: Event) -> None:
        timeout: float | None = getattr(self.config, "write_timeout", None)
        if isinstance(event, Updated) and event.idle and self._socket_gone:
            return  # a response that ended on a dead socket: nothing to keep alive
        if timeout is None or not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + timeout
                    await self.stream.send_all(event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
            if scope.cancelled_caught:
                # The client stopped reading: a half-written stream cannot be resumed, so
                # close it; the application gets http.disconnect (request cancelled).
                log.info("connection.write_timeout", timeout_s=timeout)
                self._socket_gone = True
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(self.stream)
                await self.protocol.handle(Closed())


class ResponseEndShield:
    """ASGI middleware: the final ``http.response.body`` send runs shielded from
    cancellation, so hypercorn completes the close or keep-alive step it runs inside
    that call (see the module docstring)."""

    def __init__(self, app: ASGIFramework) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable,
                       send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_shielding_end(message: dict[str, object]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    await send(message)  # type: ignore[arg-type]
            else:
                await send(message)  # type: ignore[arg-type]

        await self.app(scope, receive, send_shielding_end)  # type: ignore[arg-type]


def install_bounded_tcp_server() -> None:
    """Make hypercorn's trio worker build ``BoundedTCPServer`` for new connections."""
    worker = importlib.import_module("hypercorn.trio.run")
    if worker.TCPServer is not BoundedTCPServer:
        worker.TCPServer = BoundedTCPServer  # type: ignore[attr-defined]
