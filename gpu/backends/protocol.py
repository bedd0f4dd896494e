"""The backend protocol: how prepared programs are prepared, launched and timed.

A backend owns one execution *stream*. ``launch`` enqueues ``bind -> execute ->
read_outputs`` for one prepared program and returns at once with a ``LaunchHandle``;
launches run strictly in FIFO order, and a launch queued behind another starts the
moment the first ends (architecture: *Two frame slots, device-resident feedback*).
Every completion carries a ``policy.descriptors.ExecutionTiming`` as the seed's
*Duration estimates* define it: each rank's device interval (CPU: the worker's
measured ``execute`` interval; CUDA: event elapsed time around the graph replay), the
host wall interval from ``launch`` to observed completion, and a readiness delay of
zero (OPEN-21).

A program that raises fails only its own launch: ``LaunchHandle.result()`` raises
``ProgramFault`` (the original exception is its ``cause`` and ``__cause__``) and the
stream keeps serving later launches.

This module holds the protocol, the handle and the error family; ``gpu.backends.cpu``,
``gpu.backends.cuda`` and ``gpu.backends.fake`` implement it, and
``gpu.backends.open_backend`` picks one by name. Importing it never touches a device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpu.preparation import PreparationReport, ProgressSink
from gpu.program import PreparedProgram
from policy.descriptors import ExecutionTiming, GraphShape

__all__ = [
    "Backend",
    "BackendClosed",
    "BackendError",
    "BackendUnavailable",
    "Completion",
    "LaunchHandle",
    "PreparationReport",
    "ProgramFault",
    "ProgramNotPrepared",
    "ProgressSink",
]

BACKEND_NAMES = ("cpu", "cuda", "fake")

log = logging.getLogger("flare.gpu.backend")


class BackendError(RuntimeError):
    """Base class of the backend error family."""


class BackendUnavailable(BackendError):
    """Raised by ``open_backend`` when the named backend cannot run on this machine
    (for example ``cuda`` without a CUDA device); the message says why."""


class BackendClosed(BackendError):
    """Raised by ``launch`` or ``prepare`` after ``close()`` was called."""


class ProgramNotPrepared(BackendError):
    """Raised by ``launch`` for a program that this backend has not prepared."""


class ProgramFault(BackendError):
    """Raised by ``LaunchHandle.result()`` when the launched program raised inside
    ``bind``, ``execute`` or ``read_outputs``. ``cause`` is the original exception.
    Only that launch fails; the stream keeps working."""

    def __init__(self, shape: GraphShape, stage: str, cause: BaseException) -> None:
        super().__init__(
            f"{shape.label()}: {stage} raised {type(cause).__name__}: {cause}"
        )
        self.shape = shape
        self.stage = stage
        self.cause = cause
        self.__cause__ = cause


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """What one successful launch returned: host copies of the outputs (valid after
    later launches) and the execution timing record."""

    shape: GraphShape
    outputs: dict[str, Any]
    timing: ExecutionTiming


DoneCallback = Callable[["LaunchHandle"], None]


class LaunchHandle:
    """The pending result of one launch.

    ``done()`` never blocks; ``wait(timeout_s)`` blocks the calling thread only (the
    runtime calls it through ``trio.to_thread.run_sync``, or registers
    ``add_done_callback`` and wakes trio with ``TrioToken.run_sync_soon``);
    ``result()`` returns the ``Completion`` or raises ``ProgramFault``.
    """

    __slots__ = (
        "_callbacks", "_completion", "_event", "_fault", "_finished", "_lock",
        "launched_ns", "sequence", "shape",
    )

    def __init__(self, shape: GraphShape, *, sequence: int, launched_ns: int) -> None:
        self.shape = shape
        self.sequence = sequence
        """Position of this launch in its stream's FIFO order (0, 1, 2, ...)."""
        self.launched_ns = launched_ns
        """Host monotonic time (``time.perf_counter_ns``) at which ``launch`` was called."""
        self._event = threading.Event()
        """Set once the outcome is recorded *and* done-callbacks have run."""
        self._finished = False
        self._lock = threading.Lock()
        self._completion: Completion | None = None
        self._fault: ProgramFault | None = None
        self._callbacks: list[DoneCallback] = []

    def done(self) -> bool:
        """True once the launch has completed or faulted (never blocks)."""
        return self._finished

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block this thread until the launch finishes (and its done-callbacks have
        run); False if ``timeout_s`` passed first."""
        return self._event.wait(timeout_s)

    def result(self) -> Completion:
        """The completion; raises ``ProgramFault`` if the program raised, and
        ``BackendError`` if called before ``done()``."""
        if not self._finished:
            raise BackendError(f"{self.shape.label()}: result() called before the launch finished")
        if self._fault is not None:
            raise self._fault
        assert self._completion is not None
        return self._completion

    def add_done_callback(self, callback: DoneCallback) -> None:
        """Call ``callback(handle)`` once the launch finishes: from the completing
        thread, or right away from this thread if it already has. Keep it short and
        thread-safe (e.g. ``trio_token.run_sync_soon``)."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback(self)

    # -- used by backends -------------------------------------------------------

    def _finish(self, completion: Completion | None, fault: ProgramFault | None) -> None:
        with self._lock:
            if self._finished:
                raise BackendError(f"{self.shape.label()}: launch finished twice")
            self._completion = completion
            self._fault = fault
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        try:
            for callback in callbacks:
                try:
                    callback(self)
                except Exception:  # a broken callback must not kill the stream's worker
                    log.exception("done-callback of %s raised", self.shape.label())
        finally:
            self._event.set()

    def set_completion(self, completion: Completion) -> None:
        """Backend side: record a successful completion and wake waiters."""
        self._finish(completion, None)

    def set_fault(self, fault: ProgramFault) -> None:
        """Backend side: record a fault and wake waiters."""
        self._finish(None, fault)


class Backend(Protocol):
    """What the runtime, the engine and the benchmark call."""

    name: str
    """``"cpu"``, ``"cuda"`` or ``"fake"``."""
    device: str
    """The torch device string programs must allocate their buffers on."""
    @property
    def lost(self) -> BackendError | None:
        """Why the stream can no longer run launches (the CPU device process died), or
        None while it serves; health reports read it."""
        ...

    def prepare(
        self, programs: Sequence[PreparedProgram], *, progress: ProgressSink | None = None
    ) -> PreparationReport:
        """Prepare (CUDA: capture, largest first, into one memory pool) every program.

        Preparation may call ``execute()`` on each program (CUDA warm-up and capture),
        so programs must be harmless when executed with their initial, inactive inputs.
        """
        ...

    def launch(self, program: PreparedProgram, inputs: Mapping[str, Any]) -> LaunchHandle:
        """Enqueue one launch and return at once. The caller must not mutate
        ``inputs`` afterwards; ``bind`` reads them later, in stream order."""
        ...

    def close(self) -> None:
        """Refuse new launches, let queued launches finish, release the stream."""
        ...
