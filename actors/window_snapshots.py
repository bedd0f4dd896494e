"""Window snapshots: how a request whose images span several windows crosses each
window boundary (seed *Prerequisites and completion*, PRE-30..36).

A window's images are all feature storage holds (``policy.vision_windows``); the vision
program places a row generation's window at compact offsets from zero
(``gpu.programs.vision``). So a request moves to its next window by starting a fresh
row generation, through the snapshot and restore copies text checkpoints use
(``gpu.frames.RowCopy``, ``gpu.programs.state_ops.copy_rows``):

- **One private snapshot row** (PRE-30). A request whose images span several windows
  (``needs_snapshot_row``) is granted a second state row by the checkpoint-allocator,
  held from admission to release, and one page for its snapshots' partial page.
- **The boundary** (``snapshot_point``): a prompt lane whose active window is later
  than the window its row generation holds. The first frame of a request needs no
  snapshot: its row initialisation is a fresh generation.
- **Drain, then snapshot** (PRE-31). A boundary lane is packed only when no frame of
  the request is in flight (``LaneSource.in_flight``; the scheduler never selects a
  prompt lane of a request with a frame in flight, and packing refuses one), so the
  row holds exactly the consumed state: position at the boundary, the pages covering
  it, its sampling parameters and seed. The frame's first copy snapshots that row into
  the private row (full pages by reference, the partial page copied, PRE-37).
- **Restore into a fresh generation** (PRE-33). The second copy restores the private
  row into the request's row (the partial page copied back into the request's own
  page). A row copy into a row begins its fresh generation: the next window's features
  are placed from offset zero. Both copies run before the frame's page updates and
  forward, in stream order.
- **A fresh generation, one logical request** (PRE-32, PRE-34). The boundary frame
  runs in a fresh scheduler epoch (``actors.window_epochs``); the request keeps its
  handle, stream, prompt, seed, sampling and usage counters, and the restored row
  samples with the snapshot's own sampling state, so output equals a single-window run.
- **Private** (PRE-35, PRE-36). A window snapshot publishes nothing to the prefix cache
  and never leaves the device: no host copy is made or needed.

Pure: no trio, no device.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.messages import SnapshotPlan
from gpu import ImageSpan, RowCopy
from policy import ImagePlan, Lane, LaneRole, window_spans

__all__ = ["needs_snapshot_row", "snapshot_point", "window_copies", "window_of"]


def needs_snapshot_row(images: Sequence[ImageSpan], window_images: int) -> bool:
    """Whether a prompt with ``images`` spans several windows of ``window_images``."""
    return len(images) > window_images


def window_of(plan: ImagePlan | None, cursor: int) -> int | None:
    """The index of the active window at ``cursor`` (None: no image ahead)."""
    if plan is None:
        return None
    images = window_spans(plan, cursor)
    return images[0] // plan.window_images if images else None


def snapshot_point(lane: Lane, plan: ImagePlan | None, *, window: int | None,
                   initialised: bool) -> int | None:
    """Where a prompt ``lane`` snapshots its request (its start), when it begins a later
    window than ``window``, the one its row generation holds; else None."""
    if lane.role is not LaneRole.PROMPT or not initialised:
        return None
    active = window_of(plan, lane.prompt_start)
    if active is None or window is None or active <= window:
        return None
    return lane.prompt_start


def window_copies(snap: SnapshotPlan) -> tuple[RowCopy, RowCopy]:
    """The snapshot of the request's row into its private row, then the restore (the
    partial page, if any, copied out to the snapshot's page and back into the
    request's own)."""
    own_partial = int(snap.page_ids[-1]) if snap.dst_page >= 0 else -1
    return (RowCopy(src_row=int(snap.row), dst_row=int(snap.scratch_row), dst_page=snap.dst_page),
            RowCopy(src_row=int(snap.scratch_row), dst_row=int(snap.row), dst_page=own_partial))
