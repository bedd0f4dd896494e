"""Start-up capture of the CPU programs' forwards, so no graph is traced mid-load.

With ``RuntimeConfig.capture_forward`` the CPU backend replays each decoder forward
from a graph traced at the program's first launch (``gpu.model.capture``). Tracing a
program's graphs takes a fraction of a second per program; paid at the first launch
while serving, it would stall the stream (and every request queued on it) in the
middle of a load. ``open_runtime`` therefore launches every generation program once
before serving, the CPU counterpart of capturing CUDA graphs at preparation.

Each warm-up frame is empty (no lanes: every token writes the sink page, MIX-15; a
wider ``speculation_enabled`` mixed program gets an empty ``SpeculativeMixedFrame``,
no prompt row and no decode lanes), except the prefill programs', which take one
token of prompt on row 0 and write page 0: nothing owns a row or page before serving,
and every request's first frame re-initialises its row and reads only KV positions it
wrote (as in ``actors.calibration``). The warm-up launches' timings are discarded:
they measured no real frame. Graphs are shared process-wide by model geometry and
shapes, so a second runtime of the same model traces nothing.

Blocking: call it from a worker thread (``trio.to_thread.run_sync``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from gpu import (
    FRAME_KEY,
    Backend,
    DecodeFrame,
    MixedFrame,
    PrefillFrame,
    PreparedProgram,
    SpeculativeFrame,
    SpeculativeMixedFrame,
)
from policy import GraphKind, GraphShape

log = structlog.get_logger("flare.actors.capture_warmup")

Progress = Callable[[int, int, GraphShape], None]


def warmup_frame(shape: GraphShape) -> Any | None:
    """The empty (or one-token) frame that runs ``shape``'s forwards; None for kinds
    without a decoder forward (state operations)."""
    if shape.kind is GraphKind.DECODE:
        return DecodeFrame(rows=())
    if shape.kind is GraphKind.SPECULATIVE:
        return SpeculativeFrame(rows=(), limits=())
    if shape.kind is GraphKind.MIXED:
        if shape.speculation_enabled and shape.token_capacity > 1:
            return SpeculativeMixedFrame(rows=(), limits=())
        return MixedFrame(rows=())
    if shape.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        return PrefillFrame(row=0, tokens=(0,), start_position=0, ends_prompt=False)
    return None


def capture_programs(backend: Backend, programs: Mapping[GraphShape, PreparedProgram],
                     *, progress: Progress | None = None) -> int:
    """Launch every generation program once (in catalog order) so its graphs are
    traced before serving; returns how many programs ran. A program that fails here
    is logged and left to capture at its first real launch."""
    targets = [(shape, program, frame) for shape, program in programs.items()
               if (frame := warmup_frame(shape)) is not None]
    started = time.perf_counter()
    for index, (shape, program, frame) in enumerate(targets, start=1):
        handle = backend.launch(program, {FRAME_KEY: frame})
        handle.wait()
        try:
            handle.result()
        except Exception as exc:  # the first real launch captures instead
            log.warning("runtime.forward_capture_failed", graph=shape.label(),
                        error=str(exc))
        log.info("runtime.forward_captured", graph=shape.label(), index=index, total=len(targets))
        if progress is not None:
            progress(index, len(targets), shape)
    log.info("runtime.forwards_captured", programs=len(targets),
             seconds=round(time.perf_counter() - started, 2))
    return len(targets)
