"""Worker processes that check large request bodies off the serving process.

Decoding a multi-megabyte JSON body, walking its strings and rendering a 2,048-message
chat take tens of milliseconds of CPU that hold the serving process's interpreter lock:
in a thread they still delay the trio thread that plans frames and publishes tokens, and
every stream's next token waits. ``ParseWorkers`` sends such a body to a small pool of
processes (``--parse-workers``, started with the server, spawned fresh rather than
forked from the threaded serving process, at a lower CPU priority than serving) that
run ``app.body_checks.check_body`` on it. A body they refuse is answered with their
``ApiError`` and is never parsed in the serving process; a body they pass is prepared
there as before (it is within the bounds, so parsing it is bounded too).

The serving process only copies the bytes into a pipe (the writes release the lock)
and wakes when the verdict arrives; no thread waits on it. A worker that dies (or a
pool that cannot start) costs no request: the pool is replaced and the body is checked
in the serving process's own path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import structlog
import trio

from app.body_checks import BodyLimits, check_body
from app.chat_template import ChatTemplate
from app.errors import ApiError

log = structlog.get_logger("flare.app.parse_workers")

DEFAULT_PARSE_WORKERS = 1
MAX_PARSE_WORKERS = 16
WORKER_NICENESS = 10
"""How much lower than the serving process a worker's CPU priority is: checking an
abusive body must not take a core from the streams."""

_worker_limits: BodyLimits | None = None
_worker_template: ChatTemplate | None = None


def _start_worker(limits: BodyLimits) -> None:
    """A worker's set-up: its bounds and template; SIGINT is the serving process's."""
    global _worker_limits, _worker_template
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    _worker_limits = limits
    _worker_template = limits.template()


def _ready() -> int:
    return os.getpid()


def check_in_worker(route: str, raw: bytes) -> dict[str, Any] | None:
    """In a worker: the refusing ``ApiError``'s fields, or ``None`` when the body passes
    (or the checks fail in a way only the serving path may answer)."""
    assert _worker_limits is not None and _worker_template is not None
    try:
        check_body(route, raw, _worker_limits, _worker_template)
    except ApiError as exc:
        return dataclasses.asdict(exc)
    except Exception:  # not a refusal: the serving process's own path decides
        return None
    return None


class ParseWorkers:
    """``count`` worker processes checking bodies against ``limits``."""

    def __init__(self, count: int, limits: BodyLimits) -> None:
        self.count = count
        self.limits = limits
        self.checked = 0
        """Bodies the workers gave a verdict on."""
        self.replaced = 0
        """Pools replaced after a worker died."""
        self._executor: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Spawn the pool (without waiting for it: the first body queues behind the
        start-up)."""
        try:
            self._executor = ProcessPoolExecutor(
                self.count, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker, initargs=(self.limits,))
            self._executor.submit(_ready)
        except (RuntimeError, OSError) as exc:  # no process to spare: check in-process
            log.warning("parse_workers.start_failed", error=f"{type(exc).__name__}: {exc}")
            self._executor = None

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def pids(self) -> list[int]:
        """The workers' process ids (those started so far)."""
        executor = self._executor
        return [] if executor is None else list(executor._processes)

    async def check(self, route: str, raw: bytes) -> bool:
        """Check ``raw`` in a worker: raise its refusal, return ``True`` when it passed,
        ``False`` when no worker could give a verdict (check in the serving process)."""
        executor = self._executor
        if executor is None:
            return False
        try:
            future = executor.submit(check_in_worker, route, raw)
        except (BrokenProcessPool, RuntimeError, OSError):  # broken, shut down, no spawn
            self._replace(executor)
            return False
        await _wait(future)
        try:
            refusal = future.result()
        except BrokenProcessPool:
            self._replace(executor)
            return False
        except CancelledError:  # closed meanwhile
            return False
        self.checked += 1
        if refusal is not None:
            raise ApiError(**refusal)
        return True

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        if self._executor is not broken:
            return  # another request replaced it already
        log.warning("parse_workers.lost", replaced=self.replaced + 1)
        self.replaced += 1
        broken.shutdown(wait=False, cancel_futures=True)
        self.start()


async def _wait(future: Future[Any]) -> None:
    """Wait for ``future`` on the trio loop (woken from the pool's thread); if the wait
    is cancelled, the verdict is not wanted any more."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: Future[Any]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    future.add_done_callback(wake)
    try:
        await done.wait()
    except BaseException:
        future.cancel()
        raise
