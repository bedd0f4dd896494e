"""Paged KV cache: one page pool per layer for keys and values.

Owns the pool tensors ``[layers, pages + 1, page_size, kv_heads, head_dim]``. The
extra last page is the *sink*: padding tokens and inactive lanes of a fixed-shape
program write there, so that real pages are never mutated by padding (MIX-15). The
host-side allocator (actors/checkpoint-allocator) hands out page ids ``0..num_pages-1``
and never the sink.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.model.config import ModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheGeometry:
    """Sizes of the page pool and of one row's block table."""

    page_size: int
    num_pages: int
    max_context: int

    @property
    def blocks_per_row(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def sink_page(self) -> int:
        return self.num_pages

    @property
    def dense_context(self) -> int:
        """Key positions gathered per row: whole blocks covering ``max_context``."""
        return self.blocks_per_row * self.page_size


class PagedKVCache:
    """The device page pools for keys and values."""

    def __init__(
        self, config: ModelConfig, geometry: CacheGeometry, *, device: str, dtype: torch.dtype
    ) -> None:
        if geometry.page_size < 1 or geometry.num_pages < 1:
            raise ValueError("page_size and num_pages must be positive")
        self.geometry = geometry
        shape = (
            config.num_layers,
            geometry.num_pages + 1,
            geometry.page_size,
            config.num_kv_heads,
            config.head_dim,
        )
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def over(cls, geometry: CacheGeometry, keys: torch.Tensor, values: torch.Tensor
             ) -> PagedKVCache:
        """A cache over existing pool tensors (no allocation): how a captured forward
        (``gpu.model.capture``) sees the pools it receives as graph inputs."""
        view = cls.__new__(cls)
        view.geometry = geometry
        view.keys = keys
        view.values = values
        return view

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[N, kv_heads, head_dim]`` at flat slot ids ``[N]``."""
        flat_shape = (-1, *self.keys.shape[3:])
        self.keys[layer].view(flat_shape).index_copy_(0, slots, k)
        self.values[layer].view(flat_shape).index_copy_(0, slots, v)

    def gather_rows(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys/values ``[R, dense_context, kv_heads, head_dim]`` of tables ``[R, nb]``."""
        rows = block_tables.shape[0]
        flat = block_tables.reshape(-1)
        k = self.keys[layer].index_select(0, flat).view(rows, -1, *self.keys.shape[3:])
        v = self.values[layer].index_select(0, flat).view(rows, -1, *self.values.shape[3:])
        return k, v

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages ``src[i] -> dst[i]`` in every layer (sink-to-sink is a no-op)."""
        self.keys.index_copy_(1, dst, self.keys.index_select(1, src))
        self.values.index_copy_(1, dst, self.values.index_select(1, src))
