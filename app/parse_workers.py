"""Worker processes that check large request bodies off the serving process.

Decoding a multi-megabyte JSON body, walking its strings and rendering a 2,048-message
chat take tens of milliseconds of CPU that hold the serving process's interpreter lock:
in a thread they still delay the trio thread that plans frames and publishes tokens, and
every stream's next token waits. ``ParseWorkers`` sends such a body to a small pool of
processes (``--parse-workers``, started with the server) that run
``app.body_checks.check_body`` on it (``app.parse_worker`` is their program). A body
they refuse is answered with their ``ApiError`` and is never decoded in the serving
process; a body they pass is prepared there as before (it is within the bounds, so
preparing it is bounded too).

A worker is a fresh interpreter (``python -c``, running ``app.parse_worker.main``:
nothing of the threaded serving process is forked), at a lower CPU priority than serving. It reads frames on its
stdin, each a 4-byte big-endian length and ``route NUL body``, and answers each with one
frame on its stdout: the pickled refusal fields, or ``None`` when the body passed. Its
first frame is the pickled ``BodyLimits``, answered once the worker is ready: the
server serves once its workers are. The serving process writes the body into the
pipe from the trio thread (non-blocking writes: other tasks run between them) and waits
for the answer there; no thread is involved. A worker that dies, stalls past
``CHECK_TIMEOUT_S`` or is interrupted mid-exchange is killed and replaced, and that
body is checked in the serving process's own path: no request fails for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import subprocess
import sys
from typing import Any

import structlog
import trio

from app.body_checks import BodyLimits
from app.errors import ApiError
from app.parse_worker import FRAME_HEADER
from app.parse_worker import __name__ as WORKER_MODULE

log = structlog.get_logger("flare.app.parse_workers")

DEFAULT_PARSE_WORKERS = 1
MAX_PARSE_WORKERS = 16
CHECK_TIMEOUT_S = 30.0
"""A worker that has not answered within this long is killed (the checks of a 4 MiB body
take tens of milliseconds)."""
PIPE_BYTES = 1 << 20
"""The body pipe's capacity (Linux's default 64 KiB would take a 4 MiB body in 64
writes, each a wake-up of the trio thread)."""
WORKER_PROGRAM = ("-c", f"from {WORKER_MODULE} import main; main()")
"""The worker's interpreter arguments."""
START_TIMEOUT_S = 60.0
"""How long a new worker may take to load (an interpreter importing the app)."""
STOP_TIMEOUT_S = 5.0
"""How long a worker whose input was closed may take to exit before it is killed."""


async def _receive_exactly(stream: trio.abc.ReceiveStream, count: int) -> bytes:
    parts: list[bytes | bytearray] = []
    while count:
        chunk = await stream.receive_some(count)
        if not chunk:
            raise trio.BrokenResourceError("the parse worker closed its output")
        parts.append(chunk)
        count -= len(chunk)
    return b"".join(parts)


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, limits: BodyLimits) -> _Worker:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = await trio.lowlevel.open_process(
            [sys.executable, *WORKER_PROGRAM], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        if isinstance(process.stdin, trio.lowlevel.FdStream) and hasattr(fcntl, "F_SETPIPE_SZ"):
            with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size
                fcntl.fcntl(process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        worker = cls(process)
        try:
            with trio.fail_after(START_TIMEOUT_S):
                await worker._send(pickle.dumps(limits))
                await worker._reply()
        except BaseException:
            await worker.stop(kill=True)
            raise
        return worker

    async def _send(self, payload: bytes, body: bytes = b"") -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(FRAME_HEADER.pack(len(payload) + len(body)) + payload)
        if body:
            await self.process.stdin.send_all(body)

    async def _reply(self) -> Any:
        assert self.process.stdout is not None
        (size,) = FRAME_HEADER.unpack(await _receive_exactly(self.process.stdout,
                                                             FRAME_HEADER.size))
        return pickle.loads(await _receive_exactly(self.process.stdout, size))

    async def check(self, route: str, raw: bytes) -> dict[str, Any] | None:
        await self._send(route.encode() + b"\0", raw)
        refusal: dict[str, Any] | None = await self._reply()
        return refusal

    async def stop(self, *, kill: bool) -> None:
        """End the worker (closing its input ends it; ``kill`` when it may be busy)."""
        with trio.CancelScope(shield=True):
            if kill:
                self.process.kill()
            with trio.move_on_after(STOP_TIMEOUT_S):
                if self.process.stdin is not None:
                    await self.process.stdin.aclose()
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
            if self.process.stdout is not None:
                await self.process.stdout.aclose()


class ParseWorkers:
    """``count`` worker processes checking bodies against ``limits``."""

    def __init__(self, count: int, limits: BodyLimits) -> None:
        self.count = count
        self.limits = limits
        self.checked = 0
        """Bodies the workers gave a verdict on."""
        self.replaced = 0
        """Workers killed and replaced (died, stalled or interrupted)."""
        self._idle: list[_Worker] = []
        self._missing = count
        """Workers to start before the next check."""
        self._slots = trio.Semaphore(count)
        self._running = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Start the workers (their interpreters load in the background: the first body
        waits for them), report started, and stop them when cancelled."""
        self._running = True
        try:
            await self._fill()
            task_status.started()
            await trio.sleep_forever()
        finally:
            self._running = False
            idle, self._idle = self._idle, []
            for worker in idle:
                await worker.stop(kill=False)

    async def _fill(self) -> None:
        while self._missing and self._running:
            try:
                self._idle.append(await _Worker.start(self.limits))
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, EOFError,
                    pickle.UnpicklingError) as exc:
                # no worker: the bodies are checked here, and no start is tried again
                log.warning("parse_workers.start_failed", error=f"{type(exc).__name__}: {exc}")
                self._missing = 0
                return
            self._missing -= 1

    def pids(self) -> list[int]:
        """The idle workers' process ids."""
        return [worker.process.pid for worker in self._idle]

    async def check(self, route: str, raw: bytes) -> bool:
        """Check ``raw`` in a worker: raise its refusal, return ``True`` when it passed,
        ``False`` when no worker could give a verdict (check in the serving process)."""
        async with self._slots:
            await self._fill()
            if not self._running or not self._idle:
                return False
            worker = self._idle.pop()
            refusal: dict[str, Any] | None = None
            try:
                with trio.fail_after(CHECK_TIMEOUT_S):
                    refusal = await worker.check(route, raw)
            except BaseException as exc:
                # dead, stalled or interrupted mid-frame: its pipe state is unknown
                self.replaced += 1
                self._missing += 1
                log.warning("parse_workers.replaced", pid=worker.process.pid,
                            cause=type(exc).__name__)
                await worker.stop(kill=True)
                if isinstance(exc, Exception):
                    return False
                raise
            if not self._running:
                await worker.stop(kill=False)
            else:
                self._idle.append(worker)
            self.checked += 1
        if refusal is not None:
            raise ApiError(**refusal)
        return True
