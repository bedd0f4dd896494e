"""Connection lifecycle over raw sockets: the server closes after the response on
``Connection: close`` and HTTP/1.0 (streams included), closes idle connections after the
keep-alive timeout, cuts off a client that stops reading (cancelling its request), and
serves at most ``max_connections`` connections at once."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import socket
from collections.abc import Sequence

import pytest
import structlog
import trio
import trio.testing
from http_fakes import FakeRuntime, TinyCodec
from http_harness import running_server

from app import ConnectionSettings, ServerHandle
from ops import cli
from ops.run_command import build_connection_settings

COMPLETIONS = "/v1/completions"


async def connect(server: ServerHandle) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", server.port)


def request_bytes(method: str, path: str, *, version: str = "1.1",
                  headers: Sequence[str] = (), body: dict[str, object] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: 127.0.0.1", *headers]
    payload = b""
    if body is not None:
        payload = json.dumps(body).encode()
        lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


async def read_response(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """One ``Content-Length`` response (head, body), leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, "connection closed before the response head"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        assert chunk, "connection closed inside the response body"
        body += chunk
    return head, body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


async def test_connection_close_request_is_closed_after_the_response(codec: TinyCodec) -> None:
    with trio.fail_after(10):
        async with running_server(FakeRuntime(codec)) as server:
            sock = await connect(server)
            await sock.send_all(request_bytes("GET", "/health", headers=["Connection: close"]))
            response = await read_to_eof(sock)
            await sock.aclose()
    assert status_of(response) == 200
    assert json.loads(response.partition(b"\r\n\r\n")[2])["status"] == "ok"


async def test_http10_request_is_closed_after_the_response(codec: TinyCodec) -> None:
    with trio.fail_after(10):
        async with running_server(FakeRuntime(codec)) as server:
            sock = await connect(server)
            await sock.send_all(request_bytes(
                "POST", COMPLETIONS, version="1.0", body={"prompt": "Hello", "max_tokens": 3}))
            response = await read_to_eof(sock)
            await sock.aclose()
    assert status_of(response) == 200
    assert json.loads(response.partition(b"\r\n\r\n")[2])["object"] == "text_completion"


@pytest.mark.parametrize(("version", "headers", "body_end"), [
    ("1.0", [], b"data: [DONE]\n\n"),  # close-delimited: nginx's default proxy protocol
    ("1.1", ["Connection: close"], b"data: [DONE]\n\n\r\n0\r\n\r\n"),  # chunked
])
async def test_a_stream_is_closed_after_done(codec: TinyCodec, version: str,
                                             headers: list[str], body_end: bytes) -> None:
    rt = FakeRuntime(codec, reply="one two three")
    with trio.fail_after(10):
        async with running_server(rt) as server:
            sock = await connect(server)
            await sock.send_all(request_bytes(
                "POST", COMPLETIONS, version=version, headers=headers,
                body={"prompt": "Hello", "max_tokens": 20, "stream": True}))
            response = await read_to_eof(sock)
            await sock.aclose()
    head, _, body = response.partition(b"\r\n\r\n")
    assert status_of(head) == 200
    assert body.endswith(body_end)
    assert rt.finished and not rt.cancelled


async def test_idle_connections_close_after_the_keep_alive_timeout(codec: TinyCodec) -> None:
    timeout = 0.3
    with trio.fail_after(10):
        async with running_server(FakeRuntime(codec), connections=ConnectionSettings(
                keep_alive_timeout_s=timeout)) as server:
            used = await connect(server)
            # Each mark is taken before the event that starts the server's timer, so a
            # late wake-up of this task cannot make a timely close look early.
            sent = trio.current_time()
            await used.send_all(request_bytes("GET", "/health"))
            head, _ = await read_response(used)
            assert status_of(head) == 200 and b"connection: close" not in head.lower()
            assert await read_to_eof(used) == b""  # idle after its response: closed
            assert trio.current_time() - sent >= timeout
            connecting = trio.current_time()
            silent = await connect(server)  # never sends a request
            assert await read_to_eof(silent) == b""
            assert trio.current_time() - connecting >= timeout
            await used.aclose()
            await silent.aclose()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
async def test_used_connections_give_their_descriptors_back(codec: TinyCodec) -> None:
    """Many clients that each send one request and then hold their connection open cost
    the server no descriptor once the keep-alive timeout has closed them."""
    with trio.fail_after(30):
        # Each client sends at once: a connection that stays silent for the keep-alive
        # timeout is closed before its request, which on a loaded machine would race.
        async with running_server(FakeRuntime(codec), connections=ConnectionSettings(
                keep_alive_timeout_s=2.0)) as server:
            gc.collect()  # descriptors other tests left to the collector close now, not mid-test
            before = len(os.listdir("/proc/self/fd"))
            clients = []
            for _ in range(40):
                sock = await connect(server)
                clients.append(sock)
                await sock.send_all(request_bytes("GET", "/health"))
            try:
                for sock in clients:
                    assert status_of((await read_response(sock))[0]) == 200
                assert server.connections.open == 40
                for sock in clients:
                    assert await read_to_eof(sock) == b""
            finally:
                for sock in clients:
                    await sock.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert server.connections.open == 0
            # None of the forty is left open (a collection another test's garbage
            # triggers may only lower the count).
            assert len(os.listdir("/proc/self/fd")) <= before


class BulkyCodec(TinyCodec):
    """Every decoded token is 32 KiB of text, so a stream fills socket buffers quickly."""

    def decode(self, token_ids: Sequence[int]) -> str:
        return super().decode(token_ids) * 4096 or "x" * 32768


async def test_a_client_that_stops_reading_is_cut_off_and_its_request_cancelled(
        codec: TinyCodec) -> None:
    rt = FakeRuntime(BulkyCodec(codec.tokenizer), reply="one two three " * 400,
                     max_context=100_000)
    with trio.fail_after(30), structlog.testing.capture_logs() as logs:
        async with running_server(rt, connections=ConnectionSettings(
                write_timeout_s=0.3)) as server:
            client = trio.socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await client.connect(("127.0.0.1", server.port))
            sock = trio.SocketStream(client)
            await sock.send_all(request_bytes(
                "POST", COMPLETIONS, body={"prompt": "Hello", "max_tokens": 1200,
                                           "stream": True}))
            # The client reads nothing: the server's writes stall, time out, and the
            # request is cancelled as on a disconnect.
            await rt.wait_until(lambda: rt.cancelled)
            assert rt.statistics().requests_running == 0
            await trio.testing.wait_all_tasks_blocked()
            assert len(server.service.inflight) == 0
            assert server.connections.open == 0
            rest = await read_to_eof(sock)  # what the kernel had buffered, then EOF
            await sock.aclose()
    assert status_of(rest) == 200 and b"[DONE]" not in rest
    assert rt.finished == [] and rt.tokens_emitted < 1200
    assert [e["timeout_s"] for e in logs if e["event"] == "connection.write_timeout"] == [0.3]
    cancelled = [e for e in logs if e["event"] == "request.cancelled"]
    assert [e["cause"] for e in cancelled] == ["client_disconnected"]


async def test_connections_beyond_the_bound_get_503_and_are_closed(codec: TinyCodec) -> None:
    with trio.fail_after(10):
        async with running_server(FakeRuntime(codec), connections=ConnectionSettings(
                max_connections=2)) as server:
            held = [await connect(server), await connect(server)]
            for sock in held:  # both are being served
                await sock.send_all(request_bytes("GET", "/health"))
                assert status_of((await read_response(sock))[0]) == 200
            assert server.connections.open == 2
            extra = await connect(server)
            await extra.send_all(request_bytes("GET", "/health"))
            refused = await read_to_eof(extra)
            await extra.aclose()
            head, _, body = refused.partition(b"\r\n\r\n")
            assert status_of(head) == 503 and b"retry-after: 1" in head.lower()
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            assert server.connections.refused == 1
            await held.pop().aclose()  # a slot frees up once the server sees the close
            await trio.testing.wait_all_tasks_blocked()
            assert server.connections.open == 1
            again = await connect(server)
            await again.send_all(request_bytes("GET", "/health"))
            assert status_of((await read_response(again))[0]) == 200
            for sock in (*held, again):
                await sock.aclose()


def test_flare_run_connection_flags_reach_the_settings(tmp_path: pathlib.Path) -> None:
    argv = ["run", "--model", str(tmp_path)]
    assert build_connection_settings(cli.build_parser(argv).parse_args(argv)) == (
        ConnectionSettings())
    argv += ["--keep-alive-timeout", "2.5", "--write-timeout", "7", "--max-connections", "9"]
    assert build_connection_settings(cli.build_parser(argv).parse_args(argv)) == (
        ConnectionSettings(keep_alive_timeout_s=2.5, write_timeout_s=7.0, max_connections=9))


@pytest.mark.parametrize(("flags", "message"), [
    (["--keep-alive-timeout", "0"], "--keep-alive-timeout must be finite and > 0"),
    (["--write-timeout", "inf"], "--write-timeout must be finite and > 0"),
    (["--write-timeout", "nan"], "--write-timeout must be finite and > 0"),
    (["--max-connections", "0"], "--max-connections must be positive"),
])
def test_invalid_connection_flags_stop_flare_run_before_loading(
        flags: list[str], message: str, tmp_path: pathlib.Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def must_not_load(config: object) -> object:
        raise AssertionError("nothing may load when a flag is invalid")

    monkeypatch.setattr("ops.run_command.open_runtime", must_not_load)
    assert cli.main(["run", "--model", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
