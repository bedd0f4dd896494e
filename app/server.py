"""Serving an app with hypercorn's trio worker inside the caller's nursery.

``await nursery.start(serve_http, app, host=..., port=0)`` returns a ``ServerHandle``
once the socket is bound (hypercorn style: readiness through ``task_status``, never
sleeps). ``bind_listener(host, port)`` binds the socket beforehand, so that a caller
with a long preparation (``flare run``) learns that the port is taken before it
prepares, and hands it over with ``listener=``. ``handle.shutdown(grace_s)`` stops admitting, lets in-flight requests finish
within the grace period, ends the rest with an error event, then stops hypercorn.

Connections follow ``ConnectionSettings`` (``app/connections.py``): closed after the
response on ``Connection: close`` and HTTP/1.0, after the keep-alive timeout when idle,
on a write the client does not take within the write timeout; at most
``max_connections`` open at once. The service's parse workers (``app.parse_workers``)
run alongside and stop with the server.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from functools import partial

import hypercorn.trio
import structlog
import trio
from quart_trio import QuartTrio

from app.connections import (
    ConnectionBound,
    ConnectionSettings,
    ResponseEndShield,
    hypercorn_config,
    install_bounded_tcp_server,
)
from app.service import FlareService

log = structlog.get_logger("flare.app.server")

# Seconds hypercorn waits for open connections after the drain; streams have already
# ended by then, so this only covers idle keep-alive connections.
CONNECTION_CLOSE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class ServerHandle:
    binds: list[str]
    service: FlareService
    connections: ConnectionBound
    """Open and refused connection counts against ``max_connections``."""
    _stop: trio.Event

    @property
    def url(self) -> str:
        """The first bound address as ``http://host:port``."""
        return self.binds[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def shutdown(self, grace_s: float) -> None:
        """Drain (see ``FlareService.drain``) and stop the HTTP server."""
        log.info("server.draining", in_flight=len(self.service.inflight), grace_s=grace_s)
        ended = await self.service.drain(grace_s)
        if ended:
            log.warning("server.requests_ended_at_shutdown", count=ended)
        self._stop.set()


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) as hypercorn binds it,
    not yet listening (connections are refused until ``serve_http`` serves it).

    Raises ``OSError`` when the address cannot be bound (in use, not local)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_http(app: QuartTrio, *, host: str = "127.0.0.1", port: int = 0,
                     connections: ConnectionSettings | None = None,
                     listener: socket.socket | None = None,
                     task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED
                     ) -> None:
    """Serve until ``ServerHandle.shutdown`` completes (or the caller cancels).

    ``listener``: a socket from ``bind_listener``, served instead of binding
    ``host:port``; the server takes it over (and closes it)."""
    install_bounded_tcp_server()
    config = hypercorn_config(connections or ConnectionSettings())
    assert config.connection_bound is not None
    if listener is not None:
        config.bind = [f"fd://{listener.detach()}"]
    else:
        config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    # Route hypercorn's own messages through the root logger (structlog's formatter).
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = CONNECTION_CLOSE_TIMEOUT_S
    stop = trio.Event()
    service: FlareService = app.extensions["flare"]
    async with trio.open_nursery() as workers:
        await workers.start(service.run_parse_workers)
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn.trio.serve, ResponseEndShield(app),
                                                config, shutdown_trigger=stop.wait,
                                                mode="asgi"))
            task_status.started(ServerHandle(binds=list(binds), service=service,
                                             connections=config.connection_bound, _stop=stop))
        workers.cancel_scope.cancel()  # the server has stopped: so do its parse workers
