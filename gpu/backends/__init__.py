"""The backends that prepare, launch and time prepared programs: the protocol
(``gpu.backends.protocol``), ``cpu`` (its device process, ``cpu_process``, by default),
``cuda`` (with its device probe, ``cuda_probe``)
and ``fake``. ``open_backend`` opens one by name; importing this package touches no
device.
"""

from __future__ import annotations

from typing import Any

from gpu.backends.protocol import (
    BACKEND_NAMES,
    Backend,
    BackendClosed,
    BackendError,
    BackendUnavailable,
    Completion,
    LaunchHandle,
    PreparationReport,
    ProgramFault,
    ProgramNotPrepared,
    ProgressSink,
)

__all__ = [
    "BACKEND_NAMES",
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
    "open_backend",
]


def open_backend(name: str, **options: Any) -> Backend:
    """Open a backend by name: ``cpu``, ``cuda`` or ``fake``.

    ``cpu`` runs prepared programs in a device process unless
    ``device_process=False`` (then on a worker thread of this process);
    ``tensor_parallel=N`` (N >= 2) runs them on N ranks, a device process each
    (``nnodes=M``: this machine's N/M of them; the others run ``flare rank``).

    Raises ``BackendUnavailable`` with a message saying why (unknown name, no CUDA
    device, cuda-python missing); never crashes at import.
    """
    if name == "cpu":
        # the default: prepared programs run in a device process (``cpu_process``);
        # ``device_process=False`` keeps the stream a thread of this process
        size = options.pop("tensor_parallel", 1)
        nnodes = options.pop("nnodes", 1)
        if size > 1:
            from gpu.backends.tensor_parallel import TensorParallelBackend

            options.pop("device_process", None)
            return TensorParallelBackend(size=size, nnodes=nnodes, **options)
        if options.pop("device_process", True):
            from gpu.backends.cpu_process import DeviceProcessBackend

            return DeviceProcessBackend(**options)
        from gpu.backends.cpu import CpuBackend

        return CpuBackend(**options)
    if name == "cuda":
        from gpu.backends.cuda import CudaBackend

        return CudaBackend(**options)
    if name == "fake":
        from gpu.backends.fake import FakeBackend

        return FakeBackend(**options)
    raise BackendUnavailable(
        f"unknown backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}"
    )
