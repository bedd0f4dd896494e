"""The ``fake`` backend: a test double with scripted timings, faults and manual completion.

It keeps the backend contract (FIFO order, per-launch output copies, ``ProgramFault``
isolation, ``ExecutionTiming`` on every completion) while letting a test decide *when*
launches finish and what they measured, so runtime tests can run on trio's autojump
clock without real execution time:

- ``FakeBackend(device_ns=...)``: the device interval each launch reports: one int, a
  mapping from shape to int, or a callable ``shape -> int``.
- ``auto_complete=True`` (default): a launch runs its program at once in the caller's
  thread and is done when ``launch`` returns.
- ``auto_complete=False``: launches queue; the test finishes them in FIFO order with
  ``complete_next()`` or ``fail_next(exc)`` and inspects ``pending()``.
- ``fault_next(exc, shape=None)``: the next launch (of ``shape``) faults with ``exc``
  instead of running.
- ``clock_ns``: the host clock for wall intervals (e.g. trio's clock in a test).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu.backends.protocol import (
    BackendClosed,
    BackendError,
    Completion,
    LaunchHandle,
    ProgramFault,
    ProgramNotPrepared,
)
from gpu.preparation import PreparationReport, ProgressSink, prepare_in_order
from gpu.program import PreparedProgram
from policy.descriptors import ExecutionTiming, GraphShape

DeviceScript = int | Mapping[GraphShape, int] | Callable[[GraphShape], int]


@dataclass(slots=True)
class FakeLaunch:
    """One recorded launch (``FakeBackend.launches`` keeps every one, in order)."""

    program: PreparedProgram
    inputs: Mapping[str, Any]
    handle: LaunchHandle


@dataclass(slots=True)
class _ScriptedFault:
    exc: Exception
    shape: GraphShape | None


@dataclass(slots=True)
class _State:
    prepared: dict[int, PreparedProgram] = field(default_factory=dict)
    queue: collections.deque[FakeLaunch] = field(default_factory=collections.deque)
    faults: list[_ScriptedFault] = field(default_factory=list)
    launches: list[FakeLaunch] = field(default_factory=list)


class FakeBackend:
    """Scripted backend for tests; see the module docstring."""

    name = "fake"
    device = "cpu"
    lost = None
    """Never lost (a test may set it to script a lost device)."""

    def __init__(
        self,
        *,
        device_ns: DeviceScript = 1_000_000,
        auto_complete: bool = True,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self._device_ns = device_ns
        self.auto_complete = auto_complete
        self._clock_ns = clock_ns
        self._lock = threading.RLock()
        self._state = _State()
        self._closed = False

    # -- Backend protocol -------------------------------------------------------

    def prepare(
        self, programs: Sequence[PreparedProgram], *, progress: ProgressSink | None = None
    ) -> PreparationReport:
        if self._closed:
            raise BackendClosed("fake backend is closed")

        def register(program: PreparedProgram) -> None:
            self._state.prepared[id(program)] = program
            return None

        return prepare_in_order(
            backend=self.name, device=self.device, programs=programs,
            prepare_one=register, progress=progress,
        )

    def launch(self, program: PreparedProgram, inputs: Mapping[str, Any]) -> LaunchHandle:
        with self._lock:
            if self._closed:
                raise BackendClosed("fake backend is closed")
            if id(program) not in self._state.prepared:
                raise ProgramNotPrepared(f"{program.shape.label()} was not prepared on fake")
            handle = LaunchHandle(
                program.shape, sequence=len(self._state.launches), launched_ns=self._clock_ns()
            )
            launch = FakeLaunch(program, inputs, handle)
            self._state.launches.append(launch)
            self._state.queue.append(launch)
            if self.auto_complete:
                self.complete_next()
        return handle

    def close(self) -> None:
        """Refuse new launches; launches still queued in manual mode finish as
        ``ProgramFault(BackendClosed)`` so no waiter hangs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._state.queue:
                launch = self._state.queue.popleft()
                launch.handle.set_fault(
                    ProgramFault(launch.program.shape, "queued", BackendClosed("backend closed"))
                )

    # -- scripting ----------------------------------------------------------------

    @property
    def launches(self) -> tuple[FakeLaunch, ...]:
        """Every launch so far, in order."""
        with self._lock:
            return tuple(self._state.launches)

    def pending(self) -> tuple[LaunchHandle, ...]:
        """Handles of launches not yet finished, in FIFO order."""
        with self._lock:
            return tuple(launch.handle for launch in self._state.queue)

    def fault_next(self, exc: Exception, *, shape: GraphShape | None = None) -> None:
        """Make the next launch (of ``shape``, or any) fault with ``exc`` in ``execute``."""
        with self._lock:
            self._state.faults.append(_ScriptedFault(exc, shape))

    def complete_next(self, *, device_ns: int | None = None) -> LaunchHandle:
        """Run the oldest queued launch and finish it; ``device_ns`` overrides the script."""
        with self._lock:
            if not self._state.queue:
                raise BackendError("fake backend: no queued launch to complete")
            launch = self._state.queue.popleft()
            self._run(launch, device_ns)
            return launch.handle

    def fail_next(self, exc: BaseException) -> LaunchHandle:
        """Finish the oldest queued launch with a ``ProgramFault`` caused by ``exc``."""
        with self._lock:
            if not self._state.queue:
                raise BackendError("fake backend: no queued launch to fail")
            launch = self._state.queue.popleft()
            launch.handle.set_fault(ProgramFault(launch.program.shape, "execute", exc))
            return launch.handle

    # -- internals ----------------------------------------------------------------

    def _scripted_device_ns(self, shape: GraphShape) -> int:
        script = self._device_ns
        if isinstance(script, int):
            return script
        if isinstance(script, Mapping):
            return int(script[shape])
        return int(script(shape))

    def _take_fault(self, shape: GraphShape) -> Exception | None:
        for i, fault in enumerate(self._state.faults):
            if fault.shape is None or fault.shape == shape:
                del self._state.faults[i]
                return fault.exc
        return None

    def _run(self, launch: FakeLaunch, device_ns: int | None) -> None:
        program, handle = launch.program, launch.handle
        scripted = self._take_fault(program.shape)
        stage = "execute"
        try:
            if scripted is not None:
                raise scripted
            stage = "bind"
            program.bind(launch.inputs)
            stage = "execute"
            program.execute()
            stage = "read_outputs"
            outputs = program.read_outputs()
        except Exception as exc:
            handle.set_fault(ProgramFault(program.shape, stage, exc))
            return
        device = device_ns if device_ns is not None else self._scripted_device_ns(program.shape)
        wall = max(self._clock_ns() - handle.launched_ns, device, 1)
        timing = ExecutionTiming(device_intervals_ns=(device,), wall_ns=wall, readiness_delay_ns=0)
        handle.set_completion(Completion(shape=program.shape, outputs=outputs, timing=timing))
