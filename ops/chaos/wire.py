"""A minimal HTTP/1.x client over raw trio sockets, for requests no library would send.

``exchange`` sends bytes as given and reads one response by its framing (no body for
HEAD, 1xx, 204 and 304; ``Content-Length``; chunked; otherwise until the server
closes), skipping ``100 Continue``. A response that does not begin within the timeout
is a hang. An event stream framed by the connection's end (HTTP/1.0) is complete at
its ``[DONE]`` event, and the server then has the close timeout to close; with
``want_close`` any other response waits for the close the same way.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from dataclasses import dataclass

import trio

READ_SIZE = 65536
KEEP_BODY = 4096  # body bytes kept in a result (enough to see an error message)
SSE_DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class Exchange:
    status: int | None
    """The final status, or None: no response (hang, or the connection dropped)."""
    headers: dict[str, str]
    body: bytes
    seconds: float
    hang: bool
    """No complete response within the timeout."""
    closed: bool | None
    """Whether the server closed the connection (None: not waited for)."""


class Reader:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.eof = False

    async def fill(self) -> bool:
        if self.eof:
            return False
        try:
            data = await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    async def until(self, marker: bytes) -> bytes | None:
        while marker not in self.buffer:
            if not await self.fill():
                return None
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    async def exactly(self, n: int) -> bytes | None:
        while len(self.buffer) < n:
            if not await self.fill():
                return None
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data


def parse_head(head: bytes) -> tuple[int, dict[str, str]] | None:
    """Status and lower-cased headers of a response head (None if it is not one)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(parts[1]), headers


async def _body(reader: Reader, status: int, headers: dict[str, str], head_only: bool,
                close_timeout_s: float) -> tuple[bytes, bool | None] | None:
    """The body and whether the server closed after it (None: not seen, the body was
    framed by its length); None for a body cut short."""
    if head_only or status in (204, 304) or 100 <= status < 200:
        return b"", None
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        while True:
            size_line = await reader.until(b"\r\n")
            if size_line is None:
                return None
            try:
                size = int(size_line.split(b";")[0].strip() or b"x", 16)
            except ValueError:
                return None
            if size == 0:
                await reader.until(b"\r\n")  # trailers end with an empty line
                return b"".join(parts), None
            chunk = await reader.exactly(size + 2)
            if chunk is None:
                return None
            parts.append(chunk[:-2])
    if "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            return None
        data = await reader.exactly(length)
        return (data, None) if data is not None else None
    # Framed by the connection's end. An event stream is complete at its [DONE] event;
    # the server then has close_timeout_s to end the connection.
    while SSE_DONE not in reader.buffer:
        if not await reader.fill():
            data, reader.buffer = reader.buffer, b""
            return data, True
    with trio.move_on_after(close_timeout_s):
        while await reader.fill():
            pass
    data, reader.buffer = reader.buffer, b""
    return data, reader.eof


async def _send(stream: trio.abc.SendStream, request: bytes) -> None:
    # The server may answer early (e.g. 413) and close; the reader gets what it said.
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(request)


async def exchange(host: str, port: int, request: bytes, *, timeout_s: float,
                   close_timeout_s: float = 0.0, want_close: bool = False) -> Exchange:
    """Send ``request`` on a new connection and read one response (see the module); a
    refused connection is a drop."""
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError:
        return Exchange(status=None, headers={}, body=b"", seconds=0.0, hang=False, closed=None)
    async with stream:
        return await exchange_on(stream, request, timeout_s=timeout_s,
                                 close_timeout_s=close_timeout_s, want_close=want_close)


async def exchange_on(stream: trio.abc.Stream, request: bytes, *, timeout_s: float,
                      close_timeout_s: float = 0.0, want_close: bool = False) -> Exchange:
    """``exchange`` on an open stream (left open; the caller closes it)."""
    started = trio.current_time()
    status: int | None = None
    headers: dict[str, str] = {}
    framed: tuple[bytes, bool | None] | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_send, stream, request)
        reader = Reader(stream)
        with trio.move_on_after(timeout_s):
            while status is None or status == 100:
                head = await reader.until(b"\r\n\r\n")
                parsed = None if head is None else parse_head(head)
                if parsed is None:
                    status = None
                    break  # the server closed without (or with a garbled) response
                status, headers = parsed
            if status is not None:
                framed = await _body(reader, status, headers, request.startswith(b"HEAD "),
                                     close_timeout_s)
        closed = None if framed is None else framed[1]
        if want_close and framed is not None and closed is None:
            with trio.move_on_after(close_timeout_s):
                while await reader.fill():
                    reader.buffer = b""
            closed = reader.eof
        nursery.cancel_scope.cancel()
    return Exchange(status=None if status == 100 else status, headers=headers,
                    body=b"" if framed is None else framed[0][:KEEP_BODY],
                    seconds=trio.current_time() - started,
                    hang=framed is None and not reader.eof, closed=closed)


def abortive(stream: trio.SocketStream) -> None:
    """Make ``stream``'s close an RST instead of a FIN (SO_LINGER with a zero timeout)."""
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def connect_small_window(host: str, port: int, receive_buffer: int = 4096
                               ) -> trio.SocketStream:
    """A connection with a small receive buffer (set before connecting, so the window
    the server sees is small too)."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)
