"""Preparing a catalog of programs: order, progress and the preparation report.

Programs are prepared largest first (the CUDA backend captures them into one shared
memory pool, so the largest capture sizes the pool and smaller ones reuse it, as
nano-vllm does). Progress goes to a progress bar on a terminal and to one log line per
shape otherwise. The ``PreparationReport`` lists the prepared catalog in preparation
order, per-shape and total workspace memory where the backend can measure it, the
catalog's maximum packed token extent (seed: *Mixed execution contract*, MIX-49) and
the capture headroom (device memory still free after preparation).

This module never touches a device: backends hand it a per-program ``prepare_one``
callable and an optional memory probe.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO

from gpu.program import PreparedProgram
from policy.descriptors import GraphShape

if TYPE_CHECKING:
    from gpu.backends.protocol import Backend

log = logging.getLogger("flare.gpu.preparation")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapePreparation:
    """One prepared shape: how long it took and the workspace memory it added
    (CUDA: growth of the shared capture pool; ``None`` where not measurable)."""

    shape: GraphShape
    seconds: float
    workspace_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """A device-memory snapshot after preparation (bytes)."""

    pool_bytes: int
    """Memory reserved by the shared capture pool and the allocator."""
    free_bytes: int
    """Device memory still free: the capture headroom."""
    total_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparationReport:
    """What preparation did (MIX-48: the same catalog the planner receives)."""

    backend: str
    device: str
    shapes: tuple[ShapePreparation, ...]
    """In preparation order: largest first."""
    seconds: float
    memory: DeviceMemory | None = None

    @property
    def catalog(self) -> tuple[GraphShape, ...]:
        return tuple(p.shape for p in self.shapes)

    @property
    def max_packed_extent(self) -> int:
        """The largest packed token extent over the catalog (MIX-16, MIX-49)."""
        return max((p.shape.max_packed_extent for p in self.shapes), default=0)

    @property
    def total_workspace_bytes(self) -> int | None:
        """Sum of per-shape workspace growth; ``None`` where nothing was measured."""
        measured = [p.workspace_bytes for p in self.shapes if p.workspace_bytes is not None]
        return sum(measured) if measured else None

    @property
    def headroom_bytes(self) -> int | None:
        """Device memory free after preparation; ``None`` on the CPU."""
        return self.memory.free_bytes if self.memory else None

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "seconds": round(self.seconds, 4),
            "max_packed_extent": self.max_packed_extent,
            "total_workspace_bytes": self.total_workspace_bytes,
            "pool_bytes": self.memory.pool_bytes if self.memory else None,
            "headroom_bytes": self.headroom_bytes,
            "shapes": [
                {
                    "label": p.shape.label(),
                    "seconds": round(p.seconds, 4),
                    "workspace_bytes": p.workspace_bytes,
                }
                for p in self.shapes
            ],
        }

    def summary(self) -> str:
        """One line for logs."""
        parts = [
            f"{len(self.shapes)} shapes on {self.backend} ({self.device}) in {self.seconds:.2f}s",
            f"max packed extent {self.max_packed_extent}",
        ]
        if self.total_workspace_bytes is not None:
            parts.append(f"workspace {_mib(self.total_workspace_bytes)}")
        if self.memory is not None:
            parts.append(f"pool {_mib(self.memory.pool_bytes)}")
            parts.append(f"headroom {_mib(self.memory.free_bytes)} of {_mib(self.memory.total_bytes)}")
        return ", ".join(parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class ProgressSink(Protocol):
    """Receives preparation progress (a terminal bar, log lines, or a test recorder)."""

    def started(self, backend: str, total: int) -> None: ...

    def shape_prepared(self, index: int, total: int, prepared: ShapePreparation) -> None: ...

    def finished(self, report: PreparationReport) -> None: ...


class LogLineProgress:
    """One structured log line per prepared shape (for logs and non-terminals)."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._log = logger

    def started(self, backend: str, total: int) -> None:
        self._log.info("event=preparation_started backend=%s shapes=%d", backend, total)

    def shape_prepared(self, index: int, total: int, prepared: ShapePreparation) -> None:
        self._log.info(
            "event=shape_prepared shape=%s index=%d total=%d seconds=%.4f workspace_bytes=%s",
            prepared.shape.label(), index + 1, total, prepared.seconds, prepared.workspace_bytes,
        )

    def finished(self, report: PreparationReport) -> None:
        self._log.info("event=preparation_finished %s", report.summary())


class TerminalProgressBar:
    """A single-line progress bar redrawn in place on a terminal."""

    WIDTH = 30

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._backend = ""

    def started(self, backend: str, total: int) -> None:
        self._backend = backend
        self._draw(0, total, "")

    def shape_prepared(self, index: int, total: int, prepared: ShapePreparation) -> None:
        self._draw(index + 1, total, prepared.shape.label())

    def finished(self, report: PreparationReport) -> None:
        self._stream.write("\n" + report.summary() + "\n")
        self._stream.flush()

    def _draw(self, done: int, total: int, label: str) -> None:
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self._stream.write(f"\rpreparing on {self._backend} [{bar}] {done}/{total} {label[:40]:<40}")
        self._stream.flush()


def default_progress(stream: TextIO | None = None) -> ProgressSink:
    """A progress bar when ``stream`` (default stderr) is a terminal, log lines otherwise."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return TerminalProgressBar(stream)
    return LogLineProgress()


def size_key(shape: GraphShape) -> tuple[int, int, int, int, int]:
    """Sort key for largest-first preparation: packed extent, then each capacity."""
    return (
        shape.max_packed_extent,
        shape.batch_capacity,
        shape.token_capacity,
        shape.prefill_capacity,
        shape.proposal_depth,
    )


def largest_first(programs: Iterable[PreparedProgram]) -> list[PreparedProgram]:
    """Programs in preparation order (stable among equal sizes)."""
    return sorted(programs, key=lambda p: size_key(p.shape), reverse=True)


def prepare_in_order(
    *,
    backend: str,
    device: str,
    programs: Sequence[PreparedProgram],
    prepare_one: Callable[[PreparedProgram], int | None],
    progress: ProgressSink | None,
    memory: Callable[[], DeviceMemory | None] = lambda: None,
) -> PreparationReport:
    """Shared driver for backends: prepare ``programs`` largest first, timing each.

    ``prepare_one(program)`` prepares one program and returns the workspace bytes it
    added (or ``None``). Duplicated shapes are refused: a shape is one cost identity.
    """
    shapes = [p.shape for p in programs]
    if len(set(shapes)) != len(shapes):
        dupes = sorted({s.label() for s in shapes if shapes.count(s) > 1})
        raise ValueError(f"duplicate shapes in the catalog: {', '.join(dupes)}")
    ordered = largest_first(programs)
    total = len(ordered)
    if progress is not None:
        progress.started(backend, total)
    start = time.perf_counter()
    done: list[ShapePreparation] = []
    for index, program in enumerate(ordered):
        t0 = time.perf_counter()
        workspace = prepare_one(program)
        prepared = ShapePreparation(
            shape=program.shape, seconds=time.perf_counter() - t0, workspace_bytes=workspace
        )
        done.append(prepared)
        if progress is not None:
            progress.shape_prepared(index, total, prepared)
    report = PreparationReport(
        backend=backend,
        device=device,
        shapes=tuple(done),
        seconds=time.perf_counter() - start,
        memory=memory(),
    )
    if progress is not None:
        progress.finished(report)
    return report


def prepare_catalog(
    backend: Backend,
    programs: Sequence[PreparedProgram],
    *,
    progress: ProgressSink | Literal["auto"] | None = "auto",
) -> PreparationReport:
    """Prepare ``programs`` on ``backend`` with progress reporting (``"auto"``: a bar
    on a terminal, log lines otherwise)."""
    sink = default_progress() if progress == "auto" else progress
    return backend.prepare(programs, progress=sink)
