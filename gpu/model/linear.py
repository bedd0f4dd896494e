"""The decoder's projections on the CPU: weights packed once for oneDNN.

A decode step multiplies a handful of rows (one per lane) by every weight matrix of
the model. Such skinny products run far below the machine's speed through
``F.linear`` (MKL's sgemm): on the embedded model they were 60 % of a
``decode[B=8]`` step. oneDNN's linear over a weight reordered once into its own
blocked layout (``pack``) runs them about twice as fast over the model's matrices
(``docs/runtime.md``, *Packed projections (CPU)*).

What changes and what does not:

- The product is the same sum in another order, so results differ from
  ``F.linear``'s in the last bits (about 1e-6 relative). A token's row does not
  depend on the other rows of the batch, and the traced graphs run the same op as
  the op-by-op forward, so replays stay bit-identical to it.
- One packed copy serves every batch size (the layout does not depend on the hint).
  It lives beside the dense weight, which the embedding lookup, sharding and the
  shared-memory transport keep using, and only in the process that executes
  (``Decoder.pack_projections`` runs at the first forward, or when a device process
  receives its programs). A packed tensor is opaque (no storage), so one that exists
  travels to a device process as the dense weight it was packed from (``source``,
  already in shared memory) and is packed again there (``gpu.backends.shared_pickling``).
- Packing applies to float32 decoders on the CPU where torch has oneDNN
  (``packs_projections``); ``FLARE_PACKED_PROJECTIONS=0`` turns it off (the dense
  ``F.linear`` of every other case).
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable

import torch

__all__ = ["PACKING_ENV", "pack", "packed_linear", "packs_projections", "source"]

PACKING_ENV = "FLARE_PACKED_PROJECTIONS"

_BATCH_HINT = 8
"""The rows oneDNN is told to expect when it picks the layout: a decode batch. The
packed bytes come out the same for any hint, so this only documents the intent."""

_sources: dict[int, torch.Tensor] = {}
"""Each live packed tensor's dense weight, by the packed tensor's id (a weak-keyed
dictionary would compare packed tensors, which they do not support)."""


def packs_projections(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a decoder whose weights are on ``device`` in ``dtype`` runs its
    projections packed."""
    if os.environ.get(PACKING_ENV, "1") == "0":
        return False
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered for oneDNN (an opaque tensor of the same
    shape; ``.to_dense()`` gives ``weight`` back exactly)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                   _BATCH_HINT)
    _sources[id(packed)] = weight
    weakref.finalize(packed, _sources.pop, id(packed), None)
    return packed


def source(packed: torch.Tensor) -> torch.Tensor:
    """The dense weight ``packed`` was packed from."""
    return _sources[id(packed)]


def _linear_pointwise(x: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


@functools.cache
def _scripted_linear() -> Callable[..., torch.Tensor]:
    """``_linear_pointwise`` as a TorchScript function: the tracer cannot record the
    op's empty scalar list, but it records a call of a scripted function."""
    with warnings.catch_warnings():
        # deprecated in favour of torch.compile, which gives no such call (torch is pinned)
        warnings.filterwarnings("ignore", category=DeprecationWarning,
                                message=r".*torch\.jit\.script")
        scripted: Callable[..., torch.Tensor] = torch.jit.script(_linear_pointwise)
        return scripted


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``pack(weight)``."""
    if torch.jit.is_tracing():  # type: ignore[attr-defined,no-untyped-call]
        return _scripted_linear()(x, packed, bias)
    return _linear_pointwise(x, packed, bias)
