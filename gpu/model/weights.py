"""Weight loading: read HF safetensors checkpoints (single file or sharded) from disk.

Owns the mapping from HF parameter names to the decoder's tensors. It checks that
every tensor the architecture needs is present with the expected shape, and casts to
the serving dtype on the serving device. It never downloads anything.

``load_weights`` can read part of a checkpoint without the rest: ``select`` names the
slices of each tensor to read (a tensor-parallel rank's share,
``gpu.model.sharding``), read through ``safetensors.safe_open(...).get_slice``; on the
``meta`` device it reads only the files' headers and returns tensors with shapes and
no data (a serving process whose ranks load their own shards).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
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


@dataclass(frozen=True, slots=True)
class WeightSource:
    """Where a decoder's weights are stored: a checkpoint directory and, for a
    checkpoint that names them otherwise, the map from a stored name to the decoder's
    (a module-level function, so a source pickles)."""

    directory: Path
    rename: Callable[[str], str | None] | None = None
    role: str = "model"
    """``model`` (the served model) or ``draft`` (a learned draft): what a rank on
    another machine names the checkpoint by (``flare rank --model``)."""


Selection = tuple[int, tuple[range, ...]]
"""Part of a tensor: a dimension (0 or 1) and the index ranges of it to keep, in order."""


def _read(part: Any, selection: Selection) -> torch.Tensor:
    """``selection`` of a safetensors slice, in memory of its own (a slice is a view of
    the whole tensor's mapped bytes)."""
    dim, spans = selection
    pieces: list[torch.Tensor] = [part[s.start:s.stop] if dim == 0 else part[:, s.start:s.stop]
                                  for s in spans]
    if len(pieces) > 1:
        return torch.cat(pieces, dim)
    return pieces[0].clone(memory_format=torch.contiguous_format)


def load_weights(
    model_dir: str | Path, config: ModelConfig, *, device: str, dtype: torch.dtype,
    select: Callable[[str], Selection | None] | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Load, check and cast every tensor the decoder of ``config`` needs: of each, the
    part ``select`` names (``config`` then describes the shard: its shapes are checked),
    or all of it. ``rename`` maps a stored name to the decoder's (None: not the
    decoder's). On ``device="meta"`` only the files' headers are read."""
    directory = Path(model_dir)
    wanted = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                name = stored if rename is None else rename(stored)
                if name not in wanted:
                    continue
                selection = None if select is None else select(name)
                if device == "meta":
                    shape = list(f.get_slice(stored).get_shape())
                    if selection is not None:
                        shape[selection[0]] = sum(len(s) for s in selection[1])
                    tensors[name] = torch.empty(shape, dtype=dtype, device="meta")
                elif selection is None and select is None:
                    tensors[name] = f.get_tensor(stored)
                elif selection is None:  # memory of its own: a view would keep the
                    tensors[name] = f.get_tensor(stored).clone()  # file's touched pages
                else:
                    tensors[name] = _read(f.get_slice(stored), selection)
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
