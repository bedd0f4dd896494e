"""Megatron-style tensor-parallel shards of a decoder and its KV pool.

Rank ``r`` of ``N`` holds:

- the query heads ``r * H/N .. (r + 1) * H/N - 1`` (``H % N == 0``) and the KV heads
  they read: ``KV/N`` of them when ``KV >= N`` (``KV % N == 0``), otherwise the one KV
  head its query heads share, replicated on ``N/KV`` ranks (``N % KV == 0``);
- the q/k/v projections (and biases) of those heads, column-parallel; the attention
  output projection's matching input columns, row-parallel;
- rows ``r * I/N ..`` of the gate and up projections (column-parallel) and the same
  input columns of the down projection (row-parallel), ``I % N == 0``;
- the embedding table, every norm and the vocabulary projection whole (replicated):
  every rank computes the full logits from the same hidden state, so sampling needs
  no gather and draws the same token ids on every rank.

After each row-parallel projection the ranks' partial products are summed
(``torch.distributed.all_reduce``, in float32) before the residual add, so every rank
carries the same hidden state. The KV pool shard keeps the rank's KV heads only
(``shard_cache``). A shard runs its forward op by op: forward capture
(``gpu.model.capture``) traces no collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu.model.config import ModelConfig, UnsupportedModelError
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import PagedKVCache

__all__ = [
    "ShardError",
    "ShardedDecoder",
    "check_shardable",
    "kv_heads_of_rank",
    "shard_cache",
    "shard_decoder",
]

AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the ranks (``torch.distributed.all_reduce``)."""


class ShardError(UnsupportedModelError):
    """Raised when a model's heads or MLP width cannot be split over the ranks (a
    start-up failure, like any model this configuration cannot serve)."""


def check_shardable(config: ModelConfig, world: int) -> None:
    """Raise ``ShardError`` naming the dimension that does not divide over ``world``."""
    if world < 1:
        raise ShardError(f"tensor-parallel size must be >= 1, got {world}")
    heads, kv = config.num_heads, config.num_kv_heads
    problem = None
    if heads % world:
        problem = f"its {heads} attention heads do not split over {world} ranks"
    elif kv % world if kv >= world else world % kv:
        problem = f"its {kv} KV heads do not split over (or replicate across) {world} ranks"
    elif config.intermediate_size % world:
        problem = f"its MLP width {config.intermediate_size} does not split over {world} ranks"
    if problem is not None:
        raise ShardError(f"tensor-parallel size {world} does not fit the model: {problem}")


def kv_heads_of_rank(num_kv_heads: int, rank: int, world: int) -> range:
    """The KV heads rank ``rank`` holds (one replicated head when fewer than ``world``)."""
    if num_kv_heads >= world:
        per = num_kv_heads // world
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // world
    return range(head, head + 1)


class ShardedDecoder(Decoder):
    """One rank's shard: the decoder forward with its row-parallel sums."""

    all_reduce: AllReduce

    def enable_capture(self) -> None:
        raise ValueError("a tensor-parallel shard runs op by op: a traced graph would "
                         "not keep its all-reduces")

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, weight).float()
        self.all_reduce(partial)
        return partial.to(x.dtype)


def _rows(t: torch.Tensor, spans: list[range], unit: int) -> torch.Tensor:
    """The rows of ``t`` in ``spans`` (each a range of ``unit``-row blocks), private."""
    return torch.cat([t[s.start * unit:s.stop * unit] for s in spans]).contiguous()


def shard_decoder(decoder: Decoder, rank: int, world: int, all_reduce: AllReduce
                  ) -> ShardedDecoder:
    """Rank ``rank``'s shard of ``decoder`` (its layout: the module doc)."""
    cfg = decoder.config
    check_shardable(cfg, world)
    heads, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_rank = heads // world
    q_heads = range(rank * per_rank, (rank + 1) * per_rank)
    kv_heads = kv_heads_of_rank(kv, rank, world)
    # rows of the fused q/k/v matrix, in head units: q heads, then k heads, then v heads
    qkv_spans = [q_heads, range(heads + kv_heads.start, heads + kv_heads.stop),
                 range(heads + kv + kv_heads.start, heads + kv + kv_heads.stop)]
    width = cfg.intermediate_size // world
    mlp = range(rank, rank + 1)
    gate_up_spans = [mlp, range(world + rank, world + rank + 1)]
    shard = ShardedDecoder.__new__(ShardedDecoder)
    shard.config = dataclasses.replace(cfg, num_heads=per_rank, num_kv_heads=len(kv_heads),
                                       intermediate_size=width)
    shard.device, shard.dtype = decoder.device, decoder.dtype
    shard.embed, shard.lm_head = decoder.embed, decoder.lm_head
    shard.rope_cos, shard.rope_sin = decoder.rope_cos, decoder.rope_sin
    shard.embed_scale = decoder.embed_scale
    shard._act = decoder._act
    shard.capture = None
    shard.all_reduce = all_reduce
    split = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    shard.w = {name: t for name, t in decoder.w.items()
               if not any(f".{p}." in name for p in split)}
    shard.qkv_weight, shard.qkv_bias, shard.gate_up_weight = [], [], []
    for i in range(cfg.num_layers):
        shard.qkv_weight.append(_rows(decoder.qkv_weight[i], qkv_spans, hd))
        bias = decoder.qkv_bias[i]
        shard.qkv_bias.append(None if bias is None else _rows(bias, qkv_spans, hd))
        shard.gate_up_weight.append(_rows(decoder.gate_up_weight[i], gate_up_spans, width))
        o_proj = f"model.layers.{i}.self_attn.o_proj.weight"
        shard.w[o_proj] = decoder.w[o_proj][:, q_heads.start * hd:q_heads.stop * hd] \
            .contiguous()
        down = f"model.layers.{i}.mlp.down_proj.weight"
        shard.w[down] = decoder.w[down][:, rank * width:(rank + 1) * width].contiguous()
    return shard


def shard_cache(cache: PagedKVCache, rank: int, world: int) -> PagedKVCache:
    """A fresh page pool for rank ``rank``'s KV heads (same geometry, zeroed)."""
    layers, pages, page_size, kv, hd = cache.keys.shape
    heads = len(kv_heads_of_rank(kv, rank, world))
    shape = (layers, pages, page_size, heads, hd)
    keys = torch.zeros(shape, dtype=cache.keys.dtype, device=cache.keys.device)
    return PagedKVCache.over(cache.geometry, keys, torch.zeros_like(keys))
