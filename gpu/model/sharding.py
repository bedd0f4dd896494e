"""Megatron-style tensor-parallel shards of a decoder and its KV pool.

Rank ``r`` of ``N`` holds:

- the query heads ``r * H/N .. (r + 1) * H/N - 1`` (``H % N == 0``) and the KV heads
  they read: ``KV/N`` of them when ``KV >= N`` (``KV % N == 0``), otherwise the one KV
  head its query heads share, replicated on ``N/KV`` ranks (``N % KV == 0``);
- the q/k/v projections (and biases) of those heads, column-parallel; the attention
  output projection's matching input columns, row-parallel;
- rows ``r * I/N ..`` of the gate and up projections (column-parallel) and the same
  input columns of the down projection (row-parallel), ``I % N == 0``;
- every norm whole, and the embedding table and the vocabulary projection either
  whole (replicated: every rank computes the full logits from the same hidden state)
  or, vocabulary-parallel, rows ``r * V/N ..`` of each (``V % N == 0``): a rank looks
  up only the tokens in its rows and the ranks sum the embeddings, and each computes
  its slice of the logits, which the ranks gather. Either way every rank ends with
  the same full logits, so the counter-based sampler draws the same token ids on
  every rank.

After each row-parallel projection the ranks' partial products are summed
(``torch.distributed.all_reduce``, in float32) before the residual add, so every rank
carries the same hidden state. A rank reads only its share of each tensor from the
checkpoint files (``load_shard``: ``ShardPlan`` says which rows or columns), never
the whole model. The KV pool shard keeps the rank's KV heads only (``shard_cache``).
A shard runs its forward op by op: forward capture (``gpu.model.capture``) traces no
collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from gpu.model.config import ModelConfig, UnsupportedModelError
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import PagedKVCache
from gpu.model.weights import Selection, load_weights

__all__ = [
    "Collectives",
    "ShardError",
    "ShardPlan",
    "ShardedDecoder",
    "check_shardable",
    "kv_heads_of_rank",
    "load_shard",
    "shard_cache",
]

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


class Collectives(Protocol):
    """What a shard asks of its group (``torch.distributed`` over the ranks)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the ranks."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' ``tensor`` concatenated along the last dimension, rank order."""


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


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which part of each checkpoint tensor rank ``rank`` of ``world`` holds (element
    ranges of the split dimension), and the shapes of its shard."""

    config: ModelConfig
    """The shard's configuration: its heads, KV heads and MLP width (full vocabulary)."""
    q: range
    kv: range
    mlp: range
    vocab: range | None
    """The rank's vocabulary rows when vocabulary-parallel, else None (replicated)."""

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world: int, *, vocab_parallel: bool = False
           ) -> ShardPlan:
        check_shardable(config, world)
        hd, per_rank = config.head_dim, config.num_heads // world
        kv_heads = kv_heads_of_rank(config.num_kv_heads, rank, world)
        width = config.intermediate_size // world
        vocab_per = config.vocab_size // world
        vocab = (range(rank * vocab_per, (rank + 1) * vocab_per)
                 if vocab_parallel and config.vocab_size % world == 0 else None)
        return cls(
            config=dataclasses.replace(config, num_heads=per_rank,
                                       num_kv_heads=len(kv_heads), intermediate_size=width),
            q=range(rank * per_rank * hd, (rank + 1) * per_rank * hd),
            kv=range(kv_heads.start * hd, kv_heads.stop * hd),
            mlp=range(rank * width, (rank + 1) * width), vocab=vocab)

    @property
    def stored_config(self) -> ModelConfig:
        """The shard's configuration as its tensors' shapes read (its vocabulary rows)."""
        if self.vocab is None:
            return self.config
        return dataclasses.replace(self.config, vocab_size=len(self.vocab))

    def selection(self, name: str) -> Selection | None:
        """The part of tensor ``name`` this rank holds (None: all of it)."""
        if name in VOCAB_TENSORS:
            return None if self.vocab is None else (0, (self.vocab,))
        for projection, dim, part in ((".q_proj.", 0, self.q), (".k_proj.", 0, self.kv),
                                      (".v_proj.", 0, self.kv), (".o_proj.", 1, self.q),
                                      (".gate_proj.", 0, self.mlp),
                                      (".up_proj.", 0, self.mlp),
                                      (".down_proj.", 1, self.mlp)):
            if projection in name:
                return dim, (part,)
        return None


class ShardedDecoder(Decoder):
    """One rank's shard: the decoder forward with its row-parallel sums and, when
    vocabulary-parallel, its embedding sum and logits gather."""

    collectives: Collectives
    vocab: range | None = None

    def enable_capture(self) -> None:
        raise ValueError("a tensor-parallel shard runs op by op: a traced graph would "
                         "not keep its all-reduces")

    def _row_parallel(self, x: torch.Tensor, name: str) -> torch.Tensor:
        partial = self._project(x, name, self.w[name]).float()
        self.collectives.all_reduce(partial)
        return partial.to(x.dtype)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return super()._embed(token_ids)
        local = token_ids - self.vocab.start
        inside = (local >= 0) & (local < len(self.vocab))
        rows = self.embed[local.clamp(0, len(self.vocab) - 1)].float()
        rows *= inside[:, None]
        self.collectives.all_reduce(rows)  # one rank holds each token's row: exact
        h = rows.to(self.embed.dtype)
        return h if self.embed_scale is None else h * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return super().logits(hidden)
        return self.collectives.all_gather(super().logits(hidden).contiguous())


def load_shard(decoder: Decoder, rank: int, world: int, collectives: Collectives, *,
               vocab_parallel: bool = False) -> ShardedDecoder:
    """Rank ``rank``'s shard of ``decoder``, read from its checkpoint (``decoder.source``)
    without the rest of the model; ``decoder``'s own weights may be placeholders."""
    source = decoder.source
    if source is None:
        raise ShardError("a decoder without a checkpoint source cannot be sharded")
    plan = ShardPlan.of(decoder.config, rank, world, vocab_parallel=vocab_parallel)
    weights = load_weights(source.directory, plan.stored_config, device=decoder.device,
                           dtype=decoder.dtype, select=plan.selection, rename=source.rename)
    shard = ShardedDecoder(plan.config, weights, max_context=decoder.rope_cos.shape[0],
                           device=decoder.device, dtype=decoder.dtype)
    shard.source = source
    shard.collectives = collectives
    shard.vocab = plan.vocab
    return shard


def shard_cache(cache: PagedKVCache, rank: int, world: int, *, device: str) -> PagedKVCache:
    """A fresh page pool on ``device`` for rank ``rank``'s KV heads (same geometry,
    zeroed); ``cache`` may be a placeholder."""
    layers, pages, page_size, kv, hd = cache.keys.shape
    heads = len(kv_heads_of_rank(kv, rank, world))
    shape = (layers, pages, page_size, heads, hd)
    keys = torch.zeros(shape, dtype=cache.keys.dtype, device=device)
    return PagedKVCache.over(cache.geometry, keys, torch.zeros_like(keys))
