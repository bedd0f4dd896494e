"""Weight loading for LLaVA-style checkpoints: split one HF checkpoint into the
language model's tensors (named as ``gpu.model.weights`` names a causal LM's, so the
decoder loads them unchanged) and the vision tower's plus projector's.

Both layouts transformers writes are read: the classic one (``vision_tower.*`` or
``vision_tower.vision_model.*``, ``multi_modal_projector.*``, ``language_model.model.*``,
``language_model.lm_head.*``) and the nested one (``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``model.language_model.*``, ``lm_head.*``). It never
downloads anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpu.model.config import ModelConfig
from gpu.model.image_processor import load_image_processor_config
from gpu.model.vision import VisionTower
from gpu.model.vision_config import VisionConfig
from gpu.model.weights import (
    WeightSource,
    checked_weights,
    expected_shapes,
    load_weights,
    read_checkpoint,
)

_RENAMES = (
    ("model.vision_tower.vision_model.", ""),
    ("model.vision_tower.", ""),
    ("vision_tower.vision_model.", ""),
    ("vision_tower.", ""),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "text:model."),
    ("language_model.model.", "text:model."),
    ("language_model.lm_head.", "text:lm_head."),
    ("lm_head.", "text:lm_head."),
)
"""HF prefix -> flare name; ``text:`` marks the language model's tensors. The first
matching prefix wins, so the longer ones come first."""


def _renamed(name: str) -> str:
    for prefix, replacement in _RENAMES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def text_name(stored: str) -> str | None:
    """The language model's name for a stored tensor (None: the vision tower's)."""
    renamed = _renamed(stored)
    return renamed.removeprefix("text:") if renamed.startswith("text:") else None


def served_source(model_dir: str | Path, vision: VisionConfig | None) -> WeightSource:
    """Where the served language model's weights are stored, under their names."""
    return WeightSource(Path(model_dir), rename=None if vision is None else text_name)


def vision_shapes(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tower and projector tensor the forward reads, with its shape."""
    d, c, p = config.hidden_size, config.num_channels, config.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.patch_embedding.weight": (d, c, p, p),
        "embeddings.class_embedding": (d,),
        "embeddings.position_embedding.weight": (config.patches_per_image + 1, d),
        "pre_layrnorm.weight": (d,),
        "pre_layrnorm.bias": (d,),
    }
    layers_used = max(i % (config.num_layers + 1) for i in config.feature_layers)
    for i in range(layers_used):
        prefix = f"encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{prefix}{norm}.weight"] = (d,)
            shapes[f"{prefix}{norm}.bias"] = (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{prefix}self_attn.{proj}.weight"] = (d, d)
            shapes[f"{prefix}self_attn.{proj}.bias"] = (d,)
        shapes[f"{prefix}mlp.fc1.weight"] = (config.intermediate_size, d)
        shapes[f"{prefix}mlp.fc1.bias"] = (config.intermediate_size,)
        shapes[f"{prefix}mlp.fc2.weight"] = (d, config.intermediate_size)
        shapes[f"{prefix}mlp.fc2.bias"] = (d,)
    text = config.text_hidden_size
    shapes["multi_modal_projector.linear_1.weight"] = (text, d * len(config.feature_layers))
    shapes["multi_modal_projector.linear_2.weight"] = (text, text)
    if config.projector_bias:
        shapes["multi_modal_projector.linear_1.bias"] = (text,)
        shapes["multi_modal_projector.linear_2.bias"] = (text,)
    return shapes


def load_vision_weights(
    model_dir: str | Path, text: ModelConfig, vision: VisionConfig, *, device: str,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(language model tensors, vision tower tensors)``, checked and cast."""
    text_tensors: dict[str, torch.Tensor] = {}
    vision_tensors: dict[str, torch.Tensor] = {}
    for name, tensor in read_checkpoint(Path(model_dir)).items():
        renamed = _renamed(name)
        if renamed.startswith("text:"):
            text_tensors[renamed[len("text:"):]] = tensor
        else:
            vision_tensors[renamed] = tensor
    return (checked_weights(text_tensors, expected_shapes(text), device=device, dtype=dtype),
            checked_weights(vision_tensors, vision_shapes(vision), device=device, dtype=dtype))


def load_served_weights(
    model_dir: str | Path, text: ModelConfig, vision: VisionConfig | None, *, device: str,
    dtype: torch.dtype, text_device: str | None = None,
) -> tuple[dict[str, torch.Tensor], VisionTower | None]:
    """The decoder's tensors and, for a vision checkpoint, its loaded vision tower.
    ``text_device`` (default ``device``): where the decoder's tensors go; ``meta``
    reads only their shapes (a serving process whose ranks load their shards)."""
    text_device = text_device or device
    if vision is None:
        return load_weights(model_dir, text, device=text_device, dtype=dtype), None
    text_weights, vision_weights = load_vision_weights(model_dir, text, vision, device=device,
                                                       dtype=dtype)
    if text_device != device:
        text_weights = load_weights(model_dir, text, device=text_device, dtype=dtype,
                                    rename=text_name)
    processor = load_image_processor_config(model_dir, vision.image_size)
    return text_weights, VisionTower(vision, vision_weights, processor=processor)
