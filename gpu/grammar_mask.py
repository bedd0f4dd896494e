"""Grammar token masks on the device (structured output).

A constrained lane's frame carries the bitmask of the tokens its grammar allows next
(computed on the host, ``actors.grammar``): one bit per vocabulary entry, packed in
little-endian 32-bit words, bit ``v % 32`` of word ``v // 32`` set when token ``v`` is
allowed. ``TokenMasks`` stages a frame's masks into one ``[lanes, words]`` int32 block
(unconstrained and padding lanes allow everything) and uploads it in stream order;
``mask_disallowed`` is what ``gpu.sampling.sample`` applies to the cleaned logits,
before temperature and filtering: a disallowed token's logit becomes ``-inf``.

Capturable: the expansion of the words into a ``[lanes, vocab]`` bool mask is fixed-shape
tensor arithmetic. Never reads the host state of a grammar; only the masks it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu.frames import FrameError

ALL_ALLOWED = -1
"""An int32 word with every bit set: all 32 tokens it covers are allowed."""


def mask_words(vocab_size: int) -> int:
    """32-bit words of one lane's mask."""
    return (vocab_size + 31) // 32


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[N, vocab_size]`` from int32 mask words ``[N, mask_words(vocab_size)]``."""
    token = torch.arange(vocab_size, device=words.device, dtype=torch.int64)
    bits = words.to(torch.int64).index_select(1, token // 32) >> (token % 32)[None, :]
    return (bits & 1).bool()


def mask_disallowed(logits: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """``logits [N, V]`` with the tokens ``token_mask`` (int32 words ``[N, words]``, or
    None for no constraint) disallows set to ``-inf``."""
    if token_mask is None:
        return logits
    keep = allowed_tokens(token_mask, logits.shape[-1])
    return logits.masked_fill(~keep, float("-inf"))


class TokenMasks:
    """One program's mask block: ``[lanes, words]`` int32 on the program's device.

    ``stage`` (host only, off the stream) turns a frame's ``(row, mask bytes)`` pairs
    into a host block, or None when no lane is constrained; ``upload`` copies it in
    stream order, and ``current`` is what the next ``execute`` applies. With
    ``always_apply`` (static, capturable execution) the block is applied on every
    execution, all-allowed when the frame has no constrained lane; otherwise an
    unconstrained frame skips masking altogether.
    """

    def __init__(self, lanes: int, vocab_size: int, *, device: torch.device | str,
                 always_apply: bool) -> None:
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self._lanes = lanes
        self._always = always_apply
        self._device = torch.full((lanes, self.words), ALL_ALLOWED, dtype=torch.int32,
                                  device=device)
        self._all_allowed = True
        """The device block holds no constraint (an all-allowed upload can be skipped)."""
        self._active = False

    def stage(self, rows: Sequence[int], masks: Sequence[tuple[int, bytes]]
              ) -> np.ndarray | None:
        """The host block for a frame whose lane ``i`` runs ``rows[i]``; raises
        ``FrameError`` for a mask of the wrong size or for a row not in the frame."""
        if not masks:
            return None
        block = np.full((self._lanes, self.words), ALL_ALLOWED, dtype=np.int32)
        lane_of = {row: i for i, row in enumerate(rows)}
        for row, mask in masks:
            if row not in lane_of:
                raise FrameError(f"token mask for row {row}, which is not in the frame")
            if len(mask) != self.words * 4:
                raise FrameError(f"token mask of {len(mask)} bytes, expected "
                                 f"{self.words * 4} (vocabulary {self.vocab_size})")
            block[lane_of[row]] = np.frombuffer(mask, dtype=np.int32)
        return block

    def upload(self, block: np.ndarray | None) -> None:
        """Make ``block`` (from ``stage``) the masks of the next execution (in stream
        order, inside ``bind``)."""
        self._active = block is not None or self._always
        if block is None:
            if self._always and not self._all_allowed:
                self._device.fill_(ALL_ALLOWED)
                self._all_allowed = True
            return
        self._device.copy_(torch.from_numpy(block))
        self._all_allowed = False

    @property
    def current(self) -> torch.Tensor | None:
        """The masks to apply to the next execution's lanes, or None for none."""
        return self._device if self._active else None
