"""What a loaded model's programs share, apart from the engine that builds them.

``EngineParts`` are the device objects every prepared program binds; ``ProgramHost``
is what attaching speculation (``gpu.programs.speculative_attach``) reads and changes
on a loaded engine; ``UnsupportedShapeError`` is what both builders raise for a shape
they cannot prepare. Kept apart from ``gpu.engine`` so that the speculative programs
need not import the engine that attaches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gpu.model.decoder import Decoder
from gpu.model.kv_cache import PagedKVCache
from gpu.program import PreparedProgram
from gpu.programs.execution import ExecutionOptions
from gpu.programs.vision import VisionProgram
from gpu.programs.workspace import Workspace
from gpu.request_state import RequestState
from policy.descriptors import GraphShape


class UnsupportedShapeError(ValueError):
    """Raised when a catalog names a shape this model engine cannot prepare."""


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The device objects the programs share (exposed for tests and benchmarks)."""

    decoder: Decoder
    cache: PagedKVCache
    state: RequestState
    workspace: Workspace
    execution: ExecutionOptions = field(default_factory=ExecutionOptions.static)
    vision: VisionProgram | None = None
    """The vision program and feature storage (vision-language checkpoints only)."""


class ProgramHost(Protocol):
    """A loaded engine as speculation sees it: its shared parts, its device and its
    prepared programs by shape (``gpu.engine.ModelEngine``)."""

    parts: EngineParts
    device: str
    programs: dict[GraphShape, PreparedProgram]
