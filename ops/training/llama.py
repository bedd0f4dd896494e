"""A plain-torch Llama decoder for training, with transformers' ``LlamaForCausalLM`` names.

Parameter names match HF exactly (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj
.weight``, the two layer norms, ``model.norm.weight``, ``lm_head.weight`` unless tied), so the
saved state dict loads in transformers with no missing or unexpected keys. The maths is the
standard Llama: RMSNorm, rotary embeddings (rotate-half form, ``rope_theta``), grouped-query
attention and a SwiGLU MLP, all without biases. Training only: there is no KV cache here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaShape:
    """The dimensions of one model; mirrors the keys of a Llama ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


def rotary_tables(shape: LlamaShape, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [length, head_dim] in HF's duplicated-half layout."""
    inv_freq = 1.0 / (
        shape.rope_theta
        ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim)
    )
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    doubled = torch.cat((angles, angles), dim=-1)
    return doubled.cos(), doubled.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        d, h, kv = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads
        self.q_proj = nn.Linear(d, h * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(h * shape.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        s = self.shape
        q = self.q_proj(x).view(batch, length, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        repeat = s.num_attention_heads // s.num_key_value_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's ``LlamaModel``: embeddings, decoder layers, final norm."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Token ids [batch, length] in, next-token logits [batch, length, vocab] out."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = LlamaBody(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rotary_tables(shape, shape.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def initialise(self, generator: torch.Generator) -> None:
        """HF's Llama initialisation (normal, std 0.02; norms at one), with residual
        projections scaled down by depth as in GPT-2 so deeper stacks start stable."""
        residual_std = 0.02 / math.sqrt(2 * self.shape.num_hidden_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    param.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.normal_(0.0, residual_std, generator=generator)
                else:
                    param.normal_(0.0, 0.02, generator=generator)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.shape.max_position_embeddings:
            raise ValueError(f"sequence of {length} exceeds max_position_embeddings")
        cos = self.rope_cos[:length].to(self.model.embed_tokens.weight.dtype)
        sin = self.rope_sin[:length].to(self.model.embed_tokens.weight.dtype)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict as HF stores it: contiguous, no ``lm_head`` when tied."""
        state = self.state_dict()
        if self.shape.tie_word_embeddings:
            state.pop("lm_head.weight")
        return {name: tensor.detach().contiguous() for name, tensor in state.items()}

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Greedy continuation (recomputing the whole context each step; fine for tiny models)."""
    ids = list(prompt_ids)
    window = model.shape.max_position_embeddings
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids[-window:]], dtype=torch.long))
        next_id = int(logits[0, -1].argmax())
        ids.append(next_id)
        if next_id in stop_ids:
            break
    return ids[len(prompt_ids) :]
