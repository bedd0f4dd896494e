"""The prepared-program protocol: what a backend launches.

A prepared program is one fixed physical shape (``policy.descriptors.GraphShape``)
with static input and output buffers allocated once. A backend launches it by
binding a frame's host inputs into the static inputs, executing the fixed-shape
computation (eagerly on the CPU backend, by CUDA-graph replay on the cuda backend)
and copying the outputs back, all in stream order, so that a frame queued behind
another never overwrites buffers the first one still reads.

``execute`` must be capturable: no host synchronisation, no allocation outside the
capture pool, no data-dependent shapes. Programs read and write device-resident
request state (pending token, position, block table, sampling parameters), which is
what lets a decode frame queue behind another decode frame with no host round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from policy.descriptors import GraphShape


class PreparedProgram(Protocol):
    """One prepared physical program."""

    @property
    def shape(self) -> GraphShape:
        """The physical identity (and cost key) of this program."""
        ...

    def bind(self, inputs: Mapping[str, Any]) -> None:
        """Copy a frame's host inputs (numpy arrays or CPU tensors) into the static
        input buffers. Called in stream order, right before ``execute``."""
        ...

    def execute(self) -> None:
        """Run the fixed-shape computation on the static buffers."""
        ...

    def read_outputs(self) -> dict[str, Any]:
        """Return host copies of the output buffers (called in stream order after
        ``execute``; the copies stay valid after later launches)."""
        ...
