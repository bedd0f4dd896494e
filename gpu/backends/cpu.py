"""The ``cpu`` backend's stream: programs run eagerly on one FIFO worker thread.

``CpuBackend`` runs that thread in the calling process (``open_backend("cpu",
device_process=False)``); by default the ``cpu`` backend runs the same stream inside a
device process (``gpu.backends.cpu_process``, ``gpu.backends.device_worker``), which
reuses ``CpuStream``, ``stage_launch`` and ``run_launch`` from here.

A stream is one daemon worker thread reading a FIFO queue. ``launch`` only enqueues
(the caller never waits for the program); the worker runs ``bind -> execute ->
read_outputs`` for each launch in order, so a launch queued behind another starts the
moment the first ends, just as a CUDA stream would run it (architecture: *Two frame
slots, device-resident feedback*). The worker measures the device interval around
``execute`` with ``time.perf_counter_ns`` (seed: *Duration estimates*, DUR-14); the
wall interval runs from ``launch`` to the moment the worker publishes the completion.

A program that raises fails only its own launch (``ProgramFault``); the worker goes on.

Captured forwards: by default the programs' decoder forward replays a TorchScript
graph traced per input shape (``gpu.model.capture``), which runs without the
interpreter lock, so the trio thread's planning and publication overlap it. Tracing
happens at a program's first launch; the worker subtracts the time it took
(``tracing_ns``) from that launch's execution interval, so the duration estimates see
what a replay costs.

Read-out: ``read_outputs`` on the worker only copies the output buffers into host
arrays (the next launch overwrites them); step programs return a ``Readout`` whose
Python result objects ``gpu.frames.result_of`` builds on the reader's thread.

Staging at launch: a program with a ``stage(inputs)`` method (the packed step
programs, their draft-maintaining wrappers and the complete speculative programs)
validates and packs its frame into a host block inside ``launch``, on the
caller's thread, while earlier frames still execute; the worker's ``bind`` then only
applies state updates and uploads the block (``bind_staged``). The packing is host
work the two-slot window hides instead of worker time between two executions. A
staging error is kept and raised in the worker as that launch's ``bind`` fault, so the
caller sees exactly what an unstaged ``bind`` would report.

Dispatch: staging and every launch run under ``torch.inference_mode``, not only
without gradients: each op then skips the autograd and view-tracking layers of torch's
dispatcher, a few microseconds an op. A CPU step dispatches several hundred small ops
(a captured graph's interpreter too), so on the embedded model that is 5-15 % of a
decode step (``flare bench programs``, one lane most). The kernels are the same, so
the outputs are bit for bit those of ``torch.no_grad``.

Intra-op threads: torch's pool is process-wide. By default the backend sets it to the
usable cores minus one (at least one), leaving a core to the host runtime (trio
actors, HTTP, tokenizer): on a 2-core machine that is one thread. Measured on a shared
2-core machine, two OpenMP threads competing with other busy processes ran the
default model's programs 5 to 10 times slower than one. ``FLARE_CPU_THREADS`` or
``CpuBackend(num_threads=N)`` overrides it; ``num_threads=0`` keeps torch's setting.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu.backends.host_allocator import keep_freed_memory
from gpu.backends.protocol import (
    BackendClosed,
    Completion,
    LaunchHandle,
    ProgramFault,
    ProgramNotPrepared,
)
from gpu.model.capture import tracing_ns
from gpu.preparation import PreparationReport, ProgressSink, prepare_in_order
from gpu.program import PreparedProgram
from policy.descriptors import ExecutionTiming


@dataclass(slots=True)
class _Launch:
    program: PreparedProgram
    inputs: Mapping[str, Any]
    handle: LaunchHandle
    staged: Any = None
    """What ``program.stage(inputs)`` returned at launch (None: bind unstaged)."""
    stage_error: Exception | None = None
    """What ``program.stage(inputs)`` raised at launch (re-raised as the bind fault)."""


def stage_launch(program: PreparedProgram, inputs: Mapping[str, Any],
                 handle: LaunchHandle) -> _Launch:
    """A launch, staged on the calling thread when the program supports staging."""
    stage = getattr(program, "stage", None)
    if stage is None or not hasattr(program, "bind_staged"):
        return _Launch(program, inputs, handle)
    try:
        with torch.inference_mode():
            return _Launch(program, inputs, handle, staged=stage(inputs))
    except Exception as exc:  # reported by the worker, in stream order
        return _Launch(program, inputs, handle, stage_error=exc)


_STOP = object()
_stream_ids = itertools.count()

THREADS_ENV = "FLARE_CPU_THREADS"


def default_cpu_threads() -> int:
    """``FLARE_CPU_THREADS`` if set, else the usable cores minus one (at least one)."""
    configured = os.environ.get(THREADS_ENV, "").strip()
    if configured:
        try:
            value = int(configured)
        except ValueError:
            raise ValueError(f"{THREADS_ENV}={configured!r} is not an integer") from None
        if value < 0:
            raise ValueError(f"{THREADS_ENV} must be >= 0, got {value}")
        return value
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def run_launch(launch: _Launch, clock_ns: Any = time.perf_counter_ns) -> None:
    """Run one launch in the current thread and finish its handle (used by the worker)."""
    program, handle = launch.program, launch.handle
    stage = "bind"
    try:
        with torch.inference_mode():  # module docstring: *Dispatch*
            if launch.stage_error is not None:
                raise launch.stage_error
            if launch.staged is not None:
                program.bind_staged(launch.staged)  # type: ignore[attr-defined]
            else:
                program.bind(launch.inputs)
            stage = "execute"
            traced_before = tracing_ns()
            t0 = clock_ns()
            program.execute()
            t1 = clock_ns()
            # a first launch that captured a graph reports what its replay costs
            t1 -= tracing_ns() - traced_before
            stage = "read_outputs"
            outputs = program.read_outputs()
    except Exception as exc:  # a program fault fails only this launch
        handle.set_fault(ProgramFault(program.shape, stage, exc))
        return
    timing = ExecutionTiming(
        device_intervals_ns=(max(t1 - t0, 1),),
        wall_ns=max(clock_ns() - handle.launched_ns, 1),
        readiness_delay_ns=0,
    )
    handle.set_completion(Completion(shape=program.shape, outputs=outputs, timing=timing))


class CpuStream:
    """One FIFO worker thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, launch: _Launch) -> None:
        self._queue.put(launch)

    def stop(self, timeout_s: float | None = None) -> None:
        """Let queued launches finish, then end the worker thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            run_launch(item)


class CpuBackend:
    """Eager execution on the host CPU, one worker thread per stream."""

    name = "cpu"
    device = "cpu"
    lost = None
    """An in-process stream is never lost."""
    resident_grammars = True
    """Each frame binds after the frame ahead executed, on this CPU, so the programs
    may hold grammar matchers per row (``gpu.grammar_rows``)."""

    def __init__(self, *, num_threads: int | None = None) -> None:
        """``num_threads``: torch intra-op threads (``None``: ``default_cpu_threads()``;
        0: leave torch's setting alone)."""
        threads = default_cpu_threads() if num_threads is None else num_threads
        if threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {threads}")
        if threads:
            torch.set_num_threads(threads)
        keep_freed_memory()  # launches reuse their temporaries' memory
        self.num_threads = torch.get_num_threads()
        """The intra-op thread count in effect after construction."""
        self._lock = threading.Lock()
        self._prepared: dict[int, PreparedProgram] = {}
        """Prepared programs by identity (held so their ids stay unique)."""
        self._sequence = 0
        self._closed = False
        self.stream_name = f"flare-cpu-stream-{next(_stream_ids)}"
        """Name of this backend's worker thread (unique per backend)."""
        self._stream = CpuStream(self.stream_name)

    def prepare(
        self, programs: Sequence[PreparedProgram], *, progress: ProgressSink | None = None
    ) -> PreparationReport:
        """Register the programs (nothing to capture on a CPU) in largest-first order."""
        if self._closed:
            raise BackendClosed("cpu backend is closed")

        def register(program: PreparedProgram) -> None:
            self._prepared[id(program)] = program
            return None

        return prepare_in_order(
            backend=self.name,
            device=self.device,
            programs=programs,
            prepare_one=register,
            progress=progress,
        )

    def launch(self, program: PreparedProgram, inputs: Mapping[str, Any]) -> LaunchHandle:
        launched_ns = time.perf_counter_ns()
        with self._lock:
            if self._closed:
                raise BackendClosed("cpu backend is closed")
            if id(program) not in self._prepared:
                raise ProgramNotPrepared(f"{program.shape.label()} was not prepared on cpu")
            handle = LaunchHandle(program.shape, sequence=self._sequence, launched_ns=launched_ns)
            self._sequence += 1
            self._stream.submit(stage_launch(program, inputs, handle))
        return handle

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stream.stop()

    def __enter__(self) -> CpuBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
