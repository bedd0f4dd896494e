"""The decoder forward over packed tokens and a paged KV cache.

Owns the transformer math for ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v bias)
and ``Qwen3ForCausalLM`` (per-head q/k RMSNorm): embeddings, rotary position
embeddings, grouped-query attention, SwiGLU MLP, final norm and the vocabulary
projection (tied or untied).

One forward serves every program kind: ``N`` packed tokens, each belonging to one of
``R`` lanes. Each token's K/V is written into the page pool at its slot first; then
every token attends to its own lane's cached positions ``<= its position`` through a
dense gather of the lane's pages. The gather covers as many blocks as the block-table
view it is given: the full row (static programs, capturable) or a host-chosen leading
slice (``gpu.programs.execution``: eager programs read only the context they need).
Prompt and decode tokens share every projection (MIX-33, MIX-38). Shapes are fixed by
the caller's buffers, so the forward is capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.model.batch import PackedBatch
from gpu.model.capture import ForwardCapture
from gpu.model.config import ModelConfig
from gpu.model.kv_cache import PagedKVCache


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _stacked_mask(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask for ``_grouped_attention``, built once per forward.

    ``mask`` bool ``[batches, 1, queries, S]`` (True: attend) becomes ``dtype``
    ``[batches, 1, group * queries, S]`` with 0 where attended and -inf elsewhere, in
    the stacked query order. SDPA would otherwise convert (and we expand) a bool mask
    in every layer.
    """
    batches, _, queries, keys = mask.shape
    if group > 1:
        mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(
            batches, 1, group * queries, keys
        )
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, float("-inf"))


def _grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    batches: int,
    queries: int,
    group: int,
) -> torch.Tensor:
    """Grouped-query attention without copying K/V per query head: the ``group`` query
    heads that share a KV head are stacked along the query axis.

    ``q`` ``[batches * queries, H, hd]``; ``keys``/``values`` ``[batches, S, kvh, hd]``;
    ``mask`` from ``_stacked_mask`` ``[batches, 1, group * queries, S]``. Returns
    ``[batches * queries, H * hd]`` (head ``h`` reads KV head ``h // group``, as in HF
    ``repeat_kv``).
    """
    kv_heads, hd = keys.shape[2], keys.shape[3]
    stacked = (
        q.reshape(batches, queries, kv_heads, group, hd)
        .permute(0, 2, 3, 1, 4)
        .reshape(batches, kv_heads, group * queries, hd)
    )
    out = F.scaled_dot_product_attention(
        stacked, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
    )
    return (
        out.view(batches, kv_heads, group, queries, hd)
        .permute(0, 3, 1, 2, 4)
        .reshape(batches * queries, kv_heads * group * hd)
    )


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
        hd = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
        )
        t = torch.arange(max_context, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos().to(dtype)
        self.rope_sin = emb.sin().to(dtype)
        self._fuse_projections()
        self.capture: ForwardCapture | None = None

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
        if self.capture is not None:
            return self.capture.forward(batch, cache)
        return self.forward_eager(batch, cache)

    def forward_eager(self, batch: PackedBatch, cache: PagedKVCache) -> torch.Tensor:
        """``forward`` dispatched op by op from Python (what a capture traces)."""
        cfg = self.config
        n = batch.token_ids.shape[0]
        h_heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = h_heads // kv_heads
        positions = batch.positions.clamp(0, self.rope_cos.shape[0] - 1)
        cos = self.rope_cos[positions][:, None, :]
        sin = self.rope_sin[positions][:, None, :]
        lanes = batch.lane_block_tables.shape[0]
        page_size = cache.geometry.page_size
        ctx = batch.lane_block_tables.shape[1] * page_size
        key_pos = torch.arange(ctx, device=batch.positions.device)
        width = batch.lane_major_width
        split = batch.phase_split
        if split is not None:
            pos_ext = torch.cat((batch.positions, batch.positions.new_zeros(1)))
            p_len, d_width = split.prompt_slots.shape[0], split.width
            p_table = split.prompt_block_table
            p_ctx = ctx if p_table is None else p_table.shape[1] * page_size
            p_key_pos = key_pos if p_table is None else torch.arange(
                p_ctx, device=batch.positions.device)
            prompt_mask = (p_key_pos[None, :] <= pos_ext[split.prompt_slots][:, None]).view(
                1, 1, p_len, p_ctx
            )
            decode_mask = (key_pos[None, :] <= pos_ext[split.decode_slots][:, None]).view(
                lanes, 1, d_width, ctx
            )
            mask = decode_mask
            batches, queries_per_batch = lanes, d_width
        elif width:
            if n != lanes * width:
                raise ValueError("lane-major layout needs N == R * W")
            mask = (key_pos[None, :] <= batch.positions[:, None]).view(lanes, 1, width, ctx)
            batches, queries_per_batch = lanes, width
        elif lanes == 1:
            # one lane (prefill): every token belongs to it, no lane test needed
            mask = (key_pos[None, :] <= batch.positions[:, None]).view(1, 1, n, ctx)
            batches, queries_per_batch = 1, n
        else:
            # mask[n, r*ctx + c]: token n sees key c of lane r iff r is its lane and c <= pos.
            causal = key_pos[None, :] <= batch.positions[:, None]
            lanes_idx = torch.arange(lanes, device=batch.positions.device)
            lane_match = batch.token_lane[:, None] == lanes_idx[None, :]
            mask = (lane_match[:, :, None] & causal[:, None, :]).reshape(1, 1, n, lanes * ctx)
            batches, queries_per_batch = 1, n

        mask = _stacked_mask(mask, group, self.dtype)
        if split is not None:
            prompt_mask = _stacked_mask(prompt_mask, group, self.dtype)
            decode_mask = mask
        h = self.embed[batch.token_ids]
        for i in range(cfg.num_layers):
            x = _rms_norm(h, self._layer(i, "input_layernorm.weight"), cfg.rms_norm_eps)
            qkv = F.linear(x, self.qkv_weight[i], self.qkv_bias[i]).view(
                n, h_heads + 2 * kv_heads, hd)
            qk = qkv[:, :h_heads + kv_heads]
            v = qkv[:, h_heads + kv_heads:]
            if cfg.qk_norm:
                qk = torch.cat((
                    _rms_norm(qk[:, :h_heads], self._layer(i, "self_attn.q_norm.weight"),
                              cfg.rms_norm_eps),
                    _rms_norm(qk[:, h_heads:], self._layer(i, "self_attn.k_norm.weight"),
                              cfg.rms_norm_eps),
                ), dim=1)
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on q and k heads at once
            q, k = qk[:, :h_heads], qk[:, h_heads:]
            cache.write(i, batch.write_slots, k, v)
            keys, values = cache.gather_rows(i, batch.lane_block_tables)  # [R, ctx, kvh, hd]
            if split is not None:
                q_ext = torch.cat((q, q.new_zeros(1, h_heads, hd)))
                if p_table is None:
                    p_keys = keys.index_select(0, split.prompt_lane)
                    p_values = values.index_select(0, split.prompt_lane)
                else:
                    p_keys, p_values = cache.gather_rows(i, p_table)
                prompt_attn = _grouped_attention(
                    q_ext[split.prompt_slots], p_keys, p_values, prompt_mask, 1, p_len, group,
                )
                decode_attn = _grouped_attention(
                    q_ext[split.decode_slots], keys, values, decode_mask, lanes, d_width, group
                )
                merged = q.new_zeros(n + 1, h_heads * hd)
                merged.index_copy_(0, split.decode_slots, decode_attn)
                merged.index_copy_(0, split.prompt_slots, prompt_attn)
                attn = merged[:n]
            else:
                if not width:
                    keys = keys.reshape(1, lanes * ctx, kv_heads, hd)
                    values = values.reshape(1, lanes * ctx, kv_heads, hd)
                attn = _grouped_attention(q, keys, values, mask, batches, queries_per_batch,
                                          group)
            h = h + F.linear(attn, self._layer(i, "self_attn.o_proj.weight"))
            x = _rms_norm(h, self._layer(i, "post_attention_layernorm.weight"), cfg.rms_norm_eps)
            gate, up = F.linear(x, self.gate_up_weight[i]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, self._layer(i, "mlp.down_proj.weight"))
        return _rms_norm(h, self.w["model.norm.weight"], cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) of hidden states ``[M, hidden]``."""
        return F.linear(hidden, self.lm_head).float()
