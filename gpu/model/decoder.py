"""The decoder forward over packed tokens and a paged KV cache.

Owns the transformer math for ``LlamaForCausalLM``, ``MistralForCausalLM`` (sliding
window), ``Qwen2ForCausalLM`` (q/k/v bias, optional sliding window),
``Qwen3ForCausalLM`` (per-head q/k RMSNorm), ``GemmaForCausalLM`` (embeddings scaled
by ``sqrt(hidden)``, ``1 + weight`` RMSNorm, GeGLU) and ``Gemma2ForCausalLM`` (Gemma's
plus sandwich norms, soft-capped attention scores and logits, alternating sliding
windows): embeddings, rotary position
embeddings (tables of ``gpu.model.rope``), grouped-query attention
(``gpu.model.attention``), gated MLP, final norm and the vocabulary projection (tied or
untied).

One forward serves every program kind: ``N`` packed tokens, each belonging to one of
``R`` lanes. Each token's K/V is written into the page pool at its slot first; then
every token attends to its own lane's cached positions ``<= its position`` (and, in a
sliding-window layer, within its window) through a dense gather of the lane's pages. The gather covers as many blocks as the block-table
view it is given: the full row (static programs, capturable) or a host-chosen leading
slice (``gpu.programs.execution``: eager programs read only the context they need).
Prompt and decode tokens share every projection (MIX-33, MIX-38). Shapes are fixed by
the caller's buffers, so the forward is capturable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu.model.attention import attention_masks, grouped_attention
from gpu.model.batch import PackedBatch
from gpu.model.capture import ForwardCapture
from gpu.model.config import ModelConfig
from gpu.model.kv_cache import PagedKVCache
from gpu.model.linear import pack, packed_linear, packs_projections
from gpu.model.rope import rope_tables
from gpu.model.weights import WeightSource

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False
              ) -> torch.Tensor:
    """RMSNorm as each family rounds it: Llama scales the normalised ``x`` after casting
    back to its dtype; Gemma (``weight`` = ``1 + w`` in float32) before."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (xf * weight).to(dtype)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Decoder:
    """Weights plus the packed forward; holds no per-request state."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_context: int,
        device: str,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.w = weights
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = (
            self.embed if config.tie_word_embeddings else weights["lm_head.weight"]
        )
        self.rope_cos, self.rope_sin = rope_tables(
            config.rope, config.head_dim, max_context, device=device, dtype=dtype)
        self.embed_scale: float | None = None
        if config.gemma_norms:
            # as transformers: sqrt(hidden) rounded to the serving dtype; norms scale by
            # 1 + weight in float32
            self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5).to(dtype))
            for name in [k for k in self.w if k.endswith("norm.weight")]:
                self.w[name] = 1.0 + self.w[name].float()
        self._act = _ACTIVATIONS[config.hidden_act]
        self._fuse_projections()
        self._packs = packs_projections(self.embed.device, dtype)
        self.packed: dict[str, torch.Tensor] = {}
        """Projection weights packed for oneDNN, by ``_project`` name
        (``gpu.model.linear``), once ``pack_projections`` ran; empty: every projection
        runs ``F.linear``."""
        self.capture: ForwardCapture | None = None
        self.source: WeightSource | None = None
        """The checkpoint the weights came from, which a tensor-parallel rank reads its
        shard from (``gpu.model.sharding.load_shard``); None when built from tensors."""

    def _fuse_projections(self) -> None:
        """One q/k/v and one gate/up matrix per layer (fewer, larger matmuls). The
        per-projection entries of ``self.w`` become views of the fused tensors, so no
        weight is stored twice."""
        self.qkv_weight: list[torch.Tensor] = []
        self.qkv_bias: list[torch.Tensor | None] = []
        self.gate_up_weight: list[torch.Tensor] = []
        for i in range(self.config.num_layers):
            names = [f"model.layers.{i}.self_attn.{p}_proj" for p in ("q", "k", "v")]
            weights = [self.w[f"{n}.weight"] for n in names]
            fused = torch.cat(weights)
            biases = [self.w.get(f"{n}.bias") for n in names]
            fused_bias = None
            if any(b is not None for b in biases):
                fused_bias = torch.cat([
                    b if b is not None else w.new_zeros(w.shape[0])
                    for b, w in zip(biases, weights, strict=True)
                ])
            start = 0
            for name, weight, bias in zip(names, weights, biases, strict=True):
                end = start + weight.shape[0]
                self.w[f"{name}.weight"] = fused[start:end]
                if bias is not None and fused_bias is not None:
                    self.w[f"{name}.bias"] = fused_bias[start:end]
                start = end
            self.qkv_weight.append(fused)
            self.qkv_bias.append(fused_bias)
            gate, up = (f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up"))
            gate_up = torch.cat((self.w[gate], self.w[up]))
            half = self.w[gate].shape[0]
            self.w[gate], self.w[up] = gate_up[:half], gate_up[half:]
            self.gate_up_weight.append(gate_up)

    def pack_projections(self) -> None:
        """Pack the projections where this decoder runs them packed (CPU, float32, real
        weights); idempotent. The first forward does it, in the process that executes:
        a serving process that only hands its programs to a device process never holds
        the copies, and the device process packs on arrival (``gpu.backends``)."""
        if self._packs and not self.packed:
            self.packed = self._packed_projections()

    def _packed_projections(self) -> dict[str, torch.Tensor]:
        dense = {"lm_head": self.lm_head}
        for i in range(self.config.num_layers):
            dense[f"qkv.{i}"] = self.qkv_weight[i]
            dense[f"gate_up.{i}"] = self.gate_up_weight[i]
            for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                dense[f"model.layers.{i}.{name}"] = self._layer(i, name)
        return {name: pack(weight) for name, weight in dense.items()}

    def _project(self, x: torch.Tensor, name: str, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, through the packed copy of ``weight`` (named
        ``name`` in ``packed``) where there is one."""
        packed = self.packed.get(name)
        if packed is None:
            return F.linear(x, weight, bias)
        return packed_linear(x, packed, bias)

    def _layer(self, i: int, name: str) -> torch.Tensor:
        return self.w[f"model.layers.{i}.{name}"]

    def enable_capture(self) -> None:
        """Run later forwards through traced graphs, one per input shape (CPU only:
        ``gpu.model.capture``; CUDA programs capture whole executions instead)."""
        if torch.device(self.device).type == "cuda":
            raise ValueError("forward capture is for CPU decoders; CUDA captures programs")
        if self.capture is None:
            self.capture = ForwardCapture(self)

    def forward(self, batch: PackedBatch, cache: PagedKVCache) -> torch.Tensor:
        """Final-norm hidden states ``[N, hidden]``; writes every token's K/V."""
        if self.capture is not None and batch.image_features is None:
            return self.capture.forward(batch, cache)  # captures trace token embeddings only
        return self.forward_eager(batch, cache)

    def forward_eager(self, batch: PackedBatch, cache: PagedKVCache) -> torch.Tensor:
        """``forward`` dispatched op by op from Python (what a capture traces)."""
        self.pack_projections()
        cfg = self.config
        n = batch.token_ids.shape[0]
        h_heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = h_heads // kv_heads
        eps, gemma = cfg.rms_norm_eps, cfg.gemma_norms
        scores = {"scale": cfg.attention_scale, "softcap": cfg.attention_softcap}
        positions = batch.positions.clamp(0, self.rope_cos.shape[0] - 1)
        cos = self.rope_cos[positions][:, None, :]
        sin = self.rope_sin[positions][:, None, :]
        lanes = batch.lane_block_tables.shape[0]
        ctx = batch.lane_block_tables.shape[1] * cache.geometry.page_size
        width = batch.lane_major_width
        split = batch.phase_split
        if split is not None:
            batches, queries_per_batch = lanes, split.width
        elif width:
            batches, queries_per_batch = lanes, width
        else:
            batches, queries_per_batch = 1, n
        # one pair of masks per distinct window among the layers (usually one)
        masks = {window: attention_masks(batch, cache.geometry.page_size, window, group,
                                         self.dtype)
                 for window in dict.fromkeys(cfg.layer_windows or (None,))}
        h = self._embed(batch.token_ids)
        if batch.image_features is not None:
            rows, features = batch.image_features
            h = h.index_copy(0, rows, features.to(h.dtype))
        for i in range(cfg.num_layers):
            mask, prompt_mask = masks[cfg.window(i)]
            x = _rms_norm(h, self._layer(i, "input_layernorm.weight"), eps, gemma=gemma)
            qkv = self._project(x, f"qkv.{i}", self.qkv_weight[i], self.qkv_bias[i]).view(
                n, h_heads + 2 * kv_heads, hd)
            qk = qkv[:, :h_heads + kv_heads]
            v = qkv[:, h_heads + kv_heads:]
            if cfg.qk_norm:
                qk = torch.cat((
                    _rms_norm(qk[:, :h_heads], self._layer(i, "self_attn.q_norm.weight"), eps),
                    _rms_norm(qk[:, h_heads:], self._layer(i, "self_attn.k_norm.weight"), eps),
                ), dim=1)
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on q and k heads at once
            q, k = qk[:, :h_heads], qk[:, h_heads:]
            cache.write(i, batch.write_slots, k, v)
            keys, values = cache.gather_rows(i, batch.lane_block_tables)  # [R, ctx, kvh, hd]
            if split is not None and prompt_mask is not None:
                q_ext = torch.cat((q, q.new_zeros(1, h_heads, hd)))
                if split.prompt_block_table is None:
                    p_keys = keys.index_select(0, split.prompt_lane)
                    p_values = values.index_select(0, split.prompt_lane)
                else:
                    p_keys, p_values = cache.gather_rows(i, split.prompt_block_table)
                prompt_attn = grouped_attention(
                    q_ext[split.prompt_slots], p_keys, p_values, prompt_mask, 1,
                    split.prompt_slots.shape[0], group, **scores,
                )
                decode_attn = grouped_attention(
                    q_ext[split.decode_slots], keys, values, mask, lanes, split.width, group,
                    **scores,
                )
                merged = q.new_zeros(n + 1, h_heads * hd)
                merged.index_copy_(0, split.decode_slots, decode_attn)
                merged.index_copy_(0, split.prompt_slots, prompt_attn)
                attn = merged[:n]
            else:
                if not width:
                    keys = keys.reshape(1, lanes * ctx, kv_heads, hd)
                    values = values.reshape(1, lanes * ctx, kv_heads, hd)
                attn = grouped_attention(q, keys, values, mask, batches, queries_per_batch,
                                         group, **scores)
            out = self._row_parallel(attn, f"model.layers.{i}.self_attn.o_proj.weight")
            h = self._residual(i, h, out, "post_attention_layernorm")
            x = _rms_norm(h, self._layer(i, "pre_feedforward_layernorm.weight"
                                         if cfg.sandwich_norms else
                                         "post_attention_layernorm.weight"), eps, gemma=gemma)
            gate, up = self._project(x, f"gate_up.{i}", self.gate_up_weight[i]).chunk(2, dim=-1)
            h = self._residual(i, h, self._row_parallel(self._act(gate) * up,
                                                        f"model.layers.{i}.mlp.down_proj.weight"),
                               "post_feedforward_layernorm")
        return _rms_norm(h, self.w["model.norm.weight"], eps, gemma=gemma)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (scaled where the family scales them); a
        vocabulary-parallel shard sums the ranks' rows here (``gpu.model.sharding``)."""
        h = self.embed[token_ids]
        return h if self.embed_scale is None else h * self.embed_scale

    def _row_parallel(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The output projections (attention ``o_proj``, MLP ``down_proj``, by weight
        name); a tensor-parallel shard sums the ranks' partial products here
        (``gpu.model.sharding``)."""
        return self._project(x, name, self.w[name])

    def _residual(self, i: int, h: torch.Tensor, out: torch.Tensor, norm: str) -> torch.Tensor:
        """``h + out``; with sandwich norms (Gemma2) ``out`` is normed by layer ``i``'s
        ``norm`` first."""
        if self.config.sandwich_norms:
            out = _rms_norm(out, self._layer(i, f"{norm}.weight"), self.config.rms_norm_eps,
                            gemma=True)
        return h + out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) of hidden states ``[M, hidden]``; soft-capped in the
        serving dtype where the model caps them (Gemma2), as transformers does."""
        self.pack_projections()
        logits = self._project(hidden, "lm_head", self.lm_head)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
