"""Start-up measurement of the snapshot programs, so terminal captures have a known cost.

Seed *Planning and the execution queue*, QUEUE-22: an unknown capture cost disables
extra captures. A terminal capture is such an extra in flare (docs/runtime.md,
*Checkpoints*), so without a measured SNAPSHOT program no capture would ever run and
the program would never be measured. ``open_runtime`` therefore runs every SNAPSHOT
program a few times before serving, on rows and pages no request owns yet, and the
medians seed the scheduler's duration estimates (``RuntimeParts.measured_costs``).
They are real measurements of the prepared programs (PRE-50: nothing is invented);
the first served captures refine them like any other observation.

Each calibration frame initialises ``B`` source rows at position 1 on pages
``0..B-1`` and copies them, partial page included, into the scratch rows and pages
``B..2B-1``: the copy a mid-page terminal capture makes. Every request's first frame
re-initialises its row and only reads KV positions it wrote, so the garbage left in
those rows and pages is never seen.

Blocking: call it from a worker thread (``trio.to_thread.run_sync``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from gpu import (
    FRAME_KEY,
    Backend,
    PageAppend,
    PreparedProgram,
    RowCopy,
    RowInit,
    StateOpFrame,
    StateUpdate,
)
from policy import GraphKind, GraphShape, StateOp

CALIBRATION_RUNS = 5
"""Launches per SNAPSHOT program; the median is the seeded estimate (DUR-9's median
keeps a slow first launch from setting it)."""


def snapshot_frame(lanes: int, *, state_rows: int) -> StateOpFrame:
    """A ``lanes``-wide mid-page snapshot on idle rows: sources ``0..lanes-1``, the
    last ``lanes`` rows as destinations (the allocator's scratch rows)."""
    updates: list[StateUpdate] = []
    copies: list[RowCopy] = []
    for i in range(lanes):
        updates.append(RowInit(row=i, position=1))
        updates.append(PageAppend(row=i, first_block=0, page_ids=(i,)))
        copies.append(RowCopy(src_row=i, dst_row=state_rows - lanes + i, dst_page=lanes + i))
    return StateOpFrame(copies=tuple(copies), updates=tuple(updates))


def measure_snapshot_programs(backend: Backend,
                              programs: Mapping[GraphShape, PreparedProgram], *,
                              state_rows: int) -> dict[GraphShape, int]:
    """The median device interval (ns) of each SNAPSHOT program; programs whose every
    launch reported no interval are left out (still unknown)."""
    measured: dict[GraphShape, int] = {}
    for shape, program in programs.items():
        if shape.kind is not GraphKind.STATE or shape.state_op is not StateOp.SNAPSHOT:
            continue
        frame = snapshot_frame(shape.batch_capacity, state_rows=state_rows)
        samples = []
        for _ in range(CALIBRATION_RUNS):
            handle = backend.launch(program, {FRAME_KEY: frame})
            handle.wait()
            samples.append(handle.result().timing.cost_sample_ns)
        positive = [s for s in samples if s > 0]
        if positive:
            measured[shape] = int(statistics.median(positive))
    return measured
