"""Device-resident request state, one row per state row.

Owns the tensors that programs read and write so that a decode frame can be queued
behind another decode frame with no host round trip (architecture: *Two frame slots,
device-resident feedback*): the pending token, the position (tokens already cached,
which is where the pending token goes), the block-table row, the sampling parameters
and the request seed. The RNG position is the sequence index of the token being
sampled, so randomness is keyed by (seed, position) and needs no extra counter.

Row ``state_rows`` (one past the last) is the *sink* row: inactive lanes point there,
its block table is all sink page, and nothing reads what programs write into it.
Host updates (initialise a row, append pages) are applied by ``apply_updates`` inside
a program's ``bind``, in stream order. On the CPU the tensors are host memory, so
``host_views`` exposes numpy views of them: updates are plain array writes there and
``bind`` reads positions and temperatures without any tensor round trip.

``draft_position`` belongs to speculative loads whose learned draft context may lag
(``gpu.draft_state``): the draft's KV is current below it. A row starts with it equal
to its position (a cached prefix's pages carry their draft KV, see ``gpu.draft_state``);
only draft-side code moves it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu.frames import FrameError, PageAppend, RowInit, StateUpdate
from gpu.model.kv_cache import CacheGeometry


class StateError(FrameError):
    """Raised when a frame names a state row, page or block outside the configured pool."""


class RequestState:
    """Per-row device tensors (``rows + 1`` rows, the last is the sink)."""

    def __init__(self, state_rows: int, geometry: CacheGeometry, *, device: str) -> None:
        if state_rows < 1:
            raise ValueError("state_rows must be positive")
        self.rows = state_rows
        self.sink_row = state_rows
        self.geometry = geometry
        n = state_rows + 1
        i64 = torch.int64
        self.pending_token = torch.zeros(n, dtype=i64, device=device)
        self.position = torch.zeros(n, dtype=i64, device=device)
        self.draft_position = torch.zeros(n, dtype=i64, device=device)
        self.block_table = torch.full(
            (n, geometry.blocks_per_row), geometry.sink_page, dtype=i64, device=device
        )
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=i64, device=device)
        self.seed = torch.zeros(n, dtype=i64, device=device)
        self.host_views: dict[str, np.ndarray] | None = (
            {name: t.numpy() for name, t in self.fields().items()}
            if torch.device(device).type == "cpu" else None
        )
        """Numpy views sharing the tensors' memory (CPU only; None on a device)."""

    def fields(self) -> dict[str, torch.Tensor]:
        """Every per-row tensor by name (snapshot/restore copy all of them)."""
        return {
            "pending_token": self.pending_token,
            "position": self.position,
            "draft_position": self.draft_position,
            "block_table": self.block_table,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }

    def check_row(self, row: int) -> None:
        if not 0 <= row < self.rows:
            raise StateError(f"state row {row} outside 0..{self.rows - 1}")

    def check_page(self, page: int) -> None:
        if not 0 <= page < self.geometry.num_pages:
            raise StateError(f"page {page} outside 0..{self.geometry.num_pages - 1}")

    def validate_updates(self, updates: Sequence[StateUpdate]) -> None:
        """Reject malformed updates before anything is written."""
        for update in updates:
            self.check_row(update.row)
            if isinstance(update, RowInit):
                if not 0 <= update.position < self.geometry.max_context:
                    raise StateError(f"position {update.position} outside the context")
            else:
                end = update.first_block + len(update.page_ids)
                if update.first_block < 0 or end > self.geometry.blocks_per_row:
                    raise StateError(
                        f"blocks {update.first_block}..{end - 1} outside the block table "
                        f"(0..{self.geometry.blocks_per_row - 1})"
                    )
                for page in update.page_ids:
                    self.check_page(page)

    def apply_updates(self, updates: Sequence[StateUpdate]) -> None:
        """Validate, then apply host updates in order (call inside ``bind``, in stream
        order)."""
        self.validate_updates(updates)
        if not updates:
            return
        host = self.host_views
        for update in updates:
            if host is not None:
                _apply_on_host(host, update, self.geometry.sink_page)
            elif isinstance(update, RowInit):
                r = update.row
                s = update.sampling
                self.position[r] = update.position
                self.draft_position[r] = update.position
                self.pending_token[r] = update.pending_token
                self.temperature[r] = s.temperature
                self.top_p[r] = s.top_p
                self.top_k[r] = s.top_k
                self.seed[r] = s.row_seed
                self.block_table[r] = self.geometry.sink_page
            elif isinstance(update, PageAppend):
                end = update.first_block + len(update.page_ids)
                self.block_table[update.row, update.first_block:end] = torch.tensor(
                    update.page_ids, dtype=torch.int64, device=self.block_table.device)


def _apply_on_host(host: dict[str, np.ndarray], update: StateUpdate, sink_page: int) -> None:
    """One update written straight into the CPU tensors' memory (same values and
    dtype conversions as the tensor writes)."""
    r = update.row
    if isinstance(update, RowInit):
        s = update.sampling
        host["position"][r] = update.position
        host["draft_position"][r] = update.position
        host["pending_token"][r] = update.pending_token
        host["temperature"][r] = s.temperature
        host["top_p"][r] = s.top_p
        host["top_k"][r] = s.top_k
        host["seed"][r] = s.row_seed
        host["block_table"][r] = sink_page
    elif isinstance(update, PageAppend):
        end = update.first_block + len(update.page_ids)
        host["block_table"][r, update.first_block:end] = update.page_ids
