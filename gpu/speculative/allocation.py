"""Device allocation of target rows under a ``SpeculativePrefixLimit`` binding.

Owns SPEC-22..30's in-program allocation (seed: *Speculative graph coverage*). Every
active lane (ceiling >= 1) keeps its first target row, the pending token, so the
cohort never changes (SPEC-24). The remaining ``P - active`` rows are admitted one at a
time from the *immediate causal frontier* (each lane's next draft prefix below its
immutable ceiling), best joint prefix probability first, ties by shorter prefix, then
by lower original slot (SPEC-28, SPEC-29). Host prices never enter (SPEC-30).

``allocate_target_rows`` is the vectorised, capturable form. Candidates ``(lane, k)``
(draft prefix length ``k``) are laid out depth-major (already ordered by depth, then
slot) and one stable sort by descending probability orders them by
(probability desc, depth asc, slot asc); the admitted set is the first ``P - active``
valid candidates. This equals the greedy frontier rule because joint prefix
probabilities are non-increasing in depth: within a lane the total order lists
``(lane, k)`` before ``(lane, k+1)`` (higher probability, or equal and shorter), so
every prefix of the order is causally closed and the order's next element is always
on the frontier, hence the frontier's best. The inputs are forced non-increasing with a
running minimum, a no-op for real joint probabilities (cumulative products of values
in [0, 1] never increase, also in floating point).

``reference_allocation`` is the literal greedy loop, for tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


def allocate_target_rows(
    joint_prefix_probability: torch.Tensor, ceilings: torch.Tensor, total_rows: int
) -> torch.Tensor:
    """Target rows per lane, int64 ``[B]``, summing to at most ``total_rows`` (P).

    ``joint_prefix_probability`` float ``[B, D]`` (the sidecar's joint plane): entry
    ``k - 1`` is the joint probability of draft prefix ``k``. ``ceilings`` int64 ``[B]``:
    immutable lane ceilings in target rows (``min(D + 1, W, request limit)``, 0 for an
    idle lane). A lane's result lies in ``1..ceiling`` (0 when idle)."""
    batch, depth = joint_prefix_probability.shape
    if total_rows < batch:
        raise ValueError(f"P={total_rows} cannot hold one row for each of B={batch} lanes")
    device = joint_prefix_probability.device
    ceilings = ceilings.clamp(min=0, max=depth + 1)
    active = ceilings > 0
    probs = torch.nan_to_num(joint_prefix_probability.float(), nan=0.0).clamp(0.0, 1.0)
    if depth > 0:
        probs = probs.cummin(dim=1).values
    k = torch.arange(1, depth + 1, device=device, dtype=torch.int64)[None, :]
    valid = k < ceilings[:, None]
    # Depth-major flattening: position order is (depth asc, slot asc).
    keys = torch.where(valid, probs, -1.0).t().reshape(-1)
    order = torch.sort(keys, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.shape[0], device=device, dtype=torch.int64)
    )
    budget = (total_rows - active.sum()).clamp(min=0)
    admitted = (rank < budget) & valid.t().reshape(-1)
    extra = admitted.reshape(depth, batch).sum(dim=0)
    return active.to(torch.int64) + extra


def reference_allocation(
    joint_prefix_probability: Sequence[Sequence[float]], ceilings: Sequence[int], total_rows: int
) -> list[int]:
    """The greedy frontier rule, literally: admit the best frontier prefix until P rows
    are used or no lane can grow."""
    lengths = [1 if c > 0 else 0 for c in ceilings]
    budget = total_rows - sum(lengths)
    while budget > 0:
        frontier = [
            (-joint_prefix_probability[lane][length - 1], length, lane)
            for lane, length in enumerate(lengths)
            if 0 < length < min(ceilings[lane], len(joint_prefix_probability[lane]) + 1)
        ]
        if not frontier:
            break
        _, _, lane = min(frontier)
        lengths[lane] += 1
        budget -= 1
    return lengths


class PackedLayout(NamedTuple):
    """Where each lane's target rows sit in a ragged program's ``P`` packed rows."""

    row_lane: torch.Tensor
    """int64 ``[P]``: the lane owning each packed row (clamped to a real lane on unused rows)."""
    row_depth: torch.Tensor
    """int64 ``[P]``: the row's index within its lane (0 = the pending token)."""
    row_used: torch.Tensor
    """bool ``[P]``: whether the row is allocated."""
    lane_offset: torch.Tensor
    """int64 ``[B]``: each lane's first packed row."""


def packed_layout(lengths: torch.Tensor, total_rows: int) -> PackedLayout:
    """Pack lanes' rows contiguously in slot order (capturable; ``sum(lengths) <= P``)."""
    ends = lengths.cumsum(dim=0)
    offsets = ends - lengths
    rows = torch.arange(total_rows, device=lengths.device, dtype=torch.int64)
    lane = torch.searchsorted(ends, rows, right=True).clamp(max=lengths.shape[0] - 1)
    depth = rows - offsets[lane]
    used = rows < ends[-1]
    return PackedLayout(row_lane=lane, row_depth=torch.where(used, depth, 0), row_used=used,
                        lane_offset=offsets)


def unpack_lane_rows(packed: torch.Tensor, layout: PackedLayout, width: int) -> torch.Tensor:
    """Gather packed per-row values ``[P, ...]`` into lane-major ``[B, W, ...]``. Slots
    at or past a lane's length hold unrelated rows: mask them by the lane's length."""
    j = torch.arange(width, device=packed.device, dtype=torch.int64)[None, :]
    index = (layout.lane_offset[:, None] + j).clamp(max=packed.shape[0] - 1)
    return packed[index]
