"""The ``cuda`` backend: CUDA-graph capture per shape, replay on a dedicated stream.

Preparation captures each program's ``execute`` with ``torch.cuda.graph`` into one
shared memory pool, largest shape first (so the largest capture sizes the pool and the
smaller ones reuse it), after a warm-up execution on the same dedicated stream.

A launch goes to the stream's worker thread, which, in FIFO order and on the dedicated
stream: binds the host inputs (stream-ordered copies into the static buffers), records
a start event with ``cudaEventRecord`` (cuda-python), replays the graph
(``cudaGraphLaunch`` on ``raw_cuda_graph_exec()``, falling back to ``replay()`` on the
stream), records an end event, waits for it with ``cudaEventSynchronize`` (blocking
the worker only, never the caller or trio), reads the outputs and reports the device
interval from ``cudaEventElapsedTime`` (seed: *Duration estimates*, DUR-14).

``cudaGraphLaunch`` does not advance torch's CUDA generator offsets the way
``CUDAGraph.replay()`` does, so captured programs must not draw from torch's global
CUDA RNG (flare's sampling is counter-based, keyed by request seed and position);
``use_graph_launch=False`` selects ``replay()`` for programs that do.

Known limit: because ``PreparedProgram.read_outputs`` returns host values, a launch is
enqueued on the device only after the previous launch's outputs were read, so two
queued frames are separated by a short host gap (worker wake-up, output copy, bind).

Without a usable device, constructing the backend raises ``BackendUnavailable`` with
``gpu.backends.cuda_probe.probe_cuda``'s reason; importing this module touches no device.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu.backends.cuda_probe import probe_cuda
from gpu.backends.protocol import (
    BackendClosed,
    BackendError,
    BackendUnavailable,
    Completion,
    LaunchHandle,
    ProgramFault,
    ProgramNotPrepared,
)
from gpu.preparation import DeviceMemory, PreparationReport, ProgressSink, prepare_in_order
from gpu.program import PreparedProgram
from policy.descriptors import ExecutionTiming

log = logging.getLogger("flare.gpu.cuda_backend")

WARMUP_EXECUTIONS = 2
"""Eager executions on the capture stream before capture (lazy init, cuBLAS workspaces)."""


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple, raising ``BackendError`` on failure."""
    from cuda.bindings import runtime

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != runtime.cudaError_t.cudaSuccess:
        raise BackendError(f"{what} failed: {err!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(slots=True)
class _Captured:
    program: PreparedProgram
    graph: torch.cuda.CUDAGraph


@dataclass(slots=True)
class _Launch:
    captured: _Captured
    inputs: Mapping[str, Any]
    handle: LaunchHandle


_STOP = object()


class CudaBackend:
    """CUDA-graph replay on one dedicated stream of one device."""

    name = "cuda"
    lost = None
    """A CUDA stream in this process is never lost (a device error faults launches)."""

    def __init__(self, *, device_index: int = 0, use_graph_launch: bool = True) -> None:
        probe = probe_cuda()
        if not probe.available:
            raise BackendUnavailable(f"cuda: {probe.describe()}")
        if device_index >= probe.count:
            raise BackendUnavailable(f"cuda: no device {device_index} ({probe.describe()})")
        from cuda.bindings import runtime

        self._rt = runtime
        self.device = f"cuda:{device_index}"
        self.device_name = probe.names[device_index]
        self._torch_device = torch.device(self.device)
        self._use_graph_launch = use_graph_launch
        with torch.cuda.device(self._torch_device):
            self._stream = torch.cuda.Stream(self._torch_device)  # type: ignore[no-untyped-call, unused-ignore]
            self._pool = torch.cuda.graph_pool_handle()
            flags = runtime.cudaEventBlockingSync
            self._start_event = _check(runtime.cudaEventCreateWithFlags(flags), "cudaEventCreate")
            self._end_event = _check(runtime.cudaEventCreateWithFlags(flags), "cudaEventCreate")
        self._captured: dict[int, _Captured] = {}
        self._lock = threading.Lock()
        self._sequence = 0
        self._closed = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._worker = threading.Thread(
            target=self._run, name=f"flare-cuda-stream-{device_index}", daemon=True
        )
        self._worker.start()

    # -- preparation --------------------------------------------------------------

    def prepare(
        self, programs: Sequence[PreparedProgram], *, progress: ProgressSink | None = None
    ) -> PreparationReport:
        if self._closed:
            raise BackendClosed("cuda backend is closed")
        return prepare_in_order(
            backend=self.name,
            device=f"{self.device} ({self.device_name})",
            programs=programs,
            prepare_one=self._capture,
            progress=progress,
            memory=self._memory,
        )

    def _capture(self, program: PreparedProgram) -> int:
        dev = self._torch_device
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        stream = self._stream
        with torch.cuda.device(dev), torch.no_grad():
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_EXECUTIONS):
                    program.execute()
            torch.cuda.current_stream(dev).wait_stream(stream)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                program.execute()
            torch.cuda.synchronize(dev)
        self._captured[id(program)] = _Captured(program, graph)
        return max(torch.cuda.memory_reserved(dev) - before, 0)

    def _memory(self) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(self._torch_device)
        return DeviceMemory(
            pool_bytes=torch.cuda.memory_reserved(self._torch_device),
            free_bytes=int(free),
            total_bytes=int(total),
        )

    # -- launching ----------------------------------------------------------------

    def launch(self, program: PreparedProgram, inputs: Mapping[str, Any]) -> LaunchHandle:
        launched_ns = time.perf_counter_ns()
        with self._lock:
            if self._closed:
                raise BackendClosed("cuda backend is closed")
            captured = self._captured.get(id(program))
            if captured is None or captured.program is not program:
                raise ProgramNotPrepared(
                    f"{program.shape.label()} was not captured on {self.device}"
                )
            handle = LaunchHandle(program.shape, sequence=self._sequence, launched_ns=launched_ns)
            self._sequence += 1
            self._queue.put(_Launch(captured, inputs, handle))
        return handle

    def close(self) -> None:
        """Refuse new launches, finish queued ones, stop the worker, free events."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._worker.join()
        for event in (self._start_event, self._end_event):
            self._rt.cudaEventDestroy(event)
        self._captured.clear()

    def _run(self) -> None:
        torch.cuda.set_device(self._torch_device)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self._run_one(item)

    def _replay(self, graph: torch.cuda.CUDAGraph, raw_stream: int) -> None:
        if self._use_graph_launch:
            try:
                exec_handle = graph.raw_cuda_graph_exec()
                _check(self._rt.cudaGraphLaunch(exec_handle, raw_stream), "cudaGraphLaunch")
                return
            except (AttributeError, RuntimeError, TypeError) as exc:
                # torch builds without raw_cuda_graph_exec, or a handle cuda-python
                # cannot take: replay on the same stream instead, from now on.
                log.warning("cudaGraphLaunch unavailable (%s); using CUDAGraph.replay()", exc)
                self._use_graph_launch = False
        graph.replay()

    def _run_one(self, launch: _Launch) -> None:
        rt, program, handle = self._rt, launch.captured.program, launch.handle
        raw_stream = self._stream.cuda_stream
        stage = "bind"
        try:
            with torch.cuda.stream(self._stream), torch.no_grad():
                program.bind(launch.inputs)
                stage = "execute"
                _check(rt.cudaEventRecord(self._start_event, raw_stream), "cudaEventRecord")
                self._replay(launch.captured.graph, raw_stream)
                _check(rt.cudaEventRecord(self._end_event, raw_stream), "cudaEventRecord")
                _check(rt.cudaEventSynchronize(self._end_event), "cudaEventSynchronize")
                elapsed_ms = _check(
                    rt.cudaEventElapsedTime(self._start_event, self._end_event),
                    "cudaEventElapsedTime",
                )
                stage = "read_outputs"
                outputs = program.read_outputs()
        except Exception as exc:
            handle.set_fault(ProgramFault(program.shape, stage, exc))
            return
        device_ns = max(round(float(elapsed_ms) * 1_000_000), 1)
        timing = ExecutionTiming(
            device_intervals_ns=(device_ns,),
            wall_ns=max(time.perf_counter_ns() - handle.launched_ns, device_ns),
            readiness_delay_ns=0,
        )
        handle.set_completion(Completion(shape=program.shape, outputs=outputs, timing=timing))
