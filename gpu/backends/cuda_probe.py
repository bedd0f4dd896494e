"""Probe for CUDA devices through cuda-python, without ever crashing.

``probe_cuda()`` answers "how many CUDA devices, what are they called", or gives the
reason there is none (cuda-python missing, no driver, zero devices, torch built without
CUDA). The ``cuda`` backend refuses to open with that reason; ``flare`` commands print
it. Nothing here runs at import time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceProbe:
    """The outcome of a probe: device names, or the reason there are none."""

    names: tuple[str, ...]
    reason: str | None = None
    """Why no device is usable (``None`` when at least one is)."""

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def available(self) -> bool:
        return self.reason is None and bool(self.names)

    def describe(self) -> str:
        if self.available:
            return f"{self.count} CUDA device(s): " + ", ".join(self.names)
        return f"no CUDA device ({self.reason})"


def _error_name(runtime: object, err: object) -> str:
    try:
        result = runtime.cudaGetErrorName(err)  # type: ignore[attr-defined]
        name = result[1]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return str(err)


def probe_cuda() -> DeviceProbe:
    """Count CUDA devices with cuda-python, then check that torch can use them."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        return DeviceProbe((), f"cuda-python is not installed: {exc}; install flare[cuda]")
    try:
        err, count = runtime.cudaGetDeviceCount()
    except Exception as exc:  # cuda-python raises when no driver library exists
        return DeviceProbe((), f"CUDA driver not usable: {exc}")
    if err != runtime.cudaError_t.cudaSuccess:
        return DeviceProbe((), f"cudaGetDeviceCount failed: {_error_name(runtime, err)}")
    if not count:
        return DeviceProbe((), "the CUDA driver reports zero devices")
    names = []
    for index in range(count):
        err, props = runtime.cudaGetDeviceProperties(index)
        if err != runtime.cudaError_t.cudaSuccess:
            names.append(f"cuda:{index}")
            continue
        raw = props.name
        text = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        names.append(text)
    import torch

    if not torch.cuda.is_available():
        return DeviceProbe(tuple(names), f"torch {torch.__version__} was built without CUDA")
    return DeviceProbe(tuple(names))


def device_memory(device: str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA ``device`` as the driver reports them now, or
    None for a device without its own memory (the CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)
