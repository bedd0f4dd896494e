"""What one decoder forward reads: ``PackedBatch``, the packed tokens with their
positions, KV write slots and lanes' block tables, and ``PhaseSplit``, the optional
split of a mixed forward's attention into a prompt phase and a decode phase (see
``gpu.model.decoder``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Device tensors describing one packed forward (all fixed-size views).

    ``token_ids``/``positions``/``write_slots``/``token_lane``: int64 ``[N]``;
    ``lane_block_tables``: int64 ``[R, blocks_per_row]``. ``lane_major_width`` W > 0
    declares the static layout ``N == R * W`` with token ``n`` in lane ``n // W``
    (decode, later speculative verification): attention then runs per lane instead
    of over every lane's keys. ``phase_split`` (mixed frames) gathers prompt and
    decode queries into fixed phase workspaces for attention (seed: *Mixed execution
    contract*), then returns the results to the packed layout. ``image_features``
    (optional): packed rows int64 ``[M]`` and their image feature tokens
    ``[M, hidden]``, which replace those rows' token embeddings (the placeholder
    positions of an image prompt).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    token_lane: torch.Tensor
    lane_block_tables: torch.Tensor
    lane_major_width: int = 0
    phase_split: PhaseSplit | None = None
    image_features: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class PhaseSplit:
    """Where each phase's queries sit in the packed layout (index ``N`` = none).

    ``prompt_slots`` int64 ``[C]``: packed index of prompt token ``j``;
    ``prompt_lane`` int64 ``[1]``: the prompt lane (any lane when there is none);
    ``decode_slots`` int64 ``[R * width]``: packed index of lane ``r``'s token ``j``.
    ``prompt_block_table`` int64 ``[1, blocks]`` (optional): the prompt lane's own
    block-table view, so prompt attention can read a different context extent from the
    decode lanes'; without it prompt attention selects the prompt lane's gathered keys.
    """

    prompt_slots: torch.Tensor
    prompt_lane: torch.Tensor
    decode_slots: torch.Tensor
    width: int
    prompt_block_table: torch.Tensor | None = None
