"""Weight loading: read HF safetensors checkpoints (single file or sharded) from disk.

Owns the mapping from HF parameter names to the decoder's tensors. It checks that
every tensor the architecture needs is present with the expected shape, and casts to
the serving dtype on the serving device. It never downloads anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from gpu.model.config import ModelConfig, ModelLoadError


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"shards named in {index.name} are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    return files


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the decoder reads, with its shape."""
    d, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q_out, d),
            p + "self_attn.k_proj.weight": (kv_out, d),
            p + "self_attn.v_proj.weight": (kv_out, d),
            p + "self_attn.o_proj.weight": (d, q_out),
            p + "mlp.gate_proj.weight": (config.intermediate_size, d),
            p + "mlp.up_proj.weight": (config.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, config.intermediate_size),
        })
        if config.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            })
        if config.sandwich_norms:
            shapes.update({
                p + "pre_feedforward_layernorm.weight": (d,),
                p + "post_feedforward_layernorm.weight": (d,),
            })
        if config.qk_norm:
            shapes.update({
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
            })
    return shapes


def load_weights(
    model_dir: str | Path, config: ModelConfig, *, device: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Load, check and cast every tensor the decoder needs."""
    directory = Path(model_dir)
    wanted = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(directory):
        for name, tensor in load_file(str(path), device="cpu").items():
            if name in wanted:
                tensors[name] = tensor
    return checked_weights(tensors, wanted, device=device, dtype=dtype)


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, on the CPU, by its HF name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(directory):
        tensors.update(load_file(str(path), device="cpu"))
    return tensors


def checked_weights(
    tensors: dict[str, torch.Tensor], wanted: dict[str, tuple[int, ...]], *, device: str,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The ``wanted`` tensors, shape-checked and cast to ``dtype`` on ``device``."""
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    out: dict[str, torch.Tensor] = {}
    for name, shape in wanted.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        out[name] = tensor.to(device=device, dtype=dtype).contiguous()
    return out
