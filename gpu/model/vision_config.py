"""Vision-language configuration: parse an HF ``LlavaForConditionalGeneration``
``config.json`` into the language model's ``ModelConfig`` and a ``VisionConfig``.

Owns the typed description of a CLIP-style vision tower and its projector (patch
geometry, encoder sizes, activation, which hidden layer feeds the projector and
whether the class token is kept) and the image placeholder token. It refuses options
it cannot run exactly, naming what is supported; it reads no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu.model.config import (
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    parse_model_config,
    read_config_json,
)

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "mistral": "MistralForCausalLM"}
"""Language models a LLaVA checkpoint may name (``text_config.model_type``)."""
_STRATEGIES = ("default", "full")


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionConfig:
    """A CLIP-style vision tower plus LLaVA's two-layer projector."""

    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]
    """Encoder hidden states fed to the projector (index into embeddings + every
    layer's output, negative from the end), concatenated along features."""
    keep_class_token: bool
    """``vision_feature_select_strategy``: ``full`` keeps the class token, ``default``
    drops it."""
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Image feature tokens (placeholder positions) one image fills."""
        return self.patches_per_image + (1 if self.keep_class_token else 0)


def is_vision_config(raw: dict[str, Any]) -> bool:
    """Whether ``config.json`` describes a vision-language architecture flare knows."""
    return any(a in VISION_ARCHITECTURES for a in raw.get("architectures") or [])


def _activation(value: Any, what: str) -> str:
    act = str(value or "quick_gelu")
    if act not in VISION_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{what} {act!r} is not supported; flare supports " + ", ".join(VISION_ACTIVATIONS))
    return act


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    text = dict(raw.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    arch = _TEXT_ARCHITECTURES.get(model_type)
    if arch is None:
        raise UnsupportedModelError(
            f"text_config.model_type {model_type!r} is not supported; flare supports "
            + ", ".join(_TEXT_ARCHITECTURES))
    text["architectures"] = [arch]
    if raw.get("dtype") or raw.get("torch_dtype"):
        text.setdefault("dtype", raw.get("dtype") or raw.get("torch_dtype"))
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return text


def parse_vision_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> tuple[ModelConfig, VisionConfig]:
    """The language model's config and the vision tower's, from a LLaVA ``config.json``."""
    if not is_vision_config(raw) or len(raw.get("architectures") or []) != 1:
        raise UnsupportedModelError(
            f"architecture {raw.get('architectures')!r} is not a vision architecture flare "
            "supports; it supports " + ", ".join(VISION_ARCHITECTURES))
    text = parse_model_config(_text_config(raw), generation)
    vision = dict(raw.get("vision_config") or {})
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise UnsupportedModelError(
            f"vision_config.model_type {vision.get('model_type')!r} is not supported; flare "
            "supports clip_vision_model")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in _STRATEGIES:
        raise UnsupportedModelError(
            f"vision_feature_select_strategy {strategy!r} is not supported; flare supports "
            + ", ".join(_STRATEGIES))
    layers = raw.get("vision_feature_layer", -2)
    feature_layers = tuple(int(x) for x in layers) if isinstance(layers, list) else (int(layers),)
    try:
        config = VisionConfig(
            image_size=int(vision.get("image_size", 224)),
            patch_size=int(vision.get("patch_size", 32)),
            num_channels=int(vision.get("num_channels", 3)),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_layers=int(vision["num_hidden_layers"]),
            num_heads=int(vision["num_attention_heads"]),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=_activation(vision.get("hidden_act"), "vision_config.hidden_act"),
            feature_layers=feature_layers,
            keep_class_token=strategy == "full",
            projector_act=_activation(raw.get("projector_hidden_act", "gelu"),
                                      "projector_hidden_act"),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            text_hidden_size=text.hidden_size,
            image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 32000))),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks vision_config key {exc.args[0]!r}") from exc
    if config.image_size % config.patch_size:
        raise UnsupportedModelError("vision_config.image_size must be a multiple of patch_size")
    if config.hidden_size % config.num_heads:
        raise UnsupportedModelError(
            "vision_config.hidden_size must be a multiple of num_attention_heads")
    if any(not -(config.num_layers + 1) <= i <= config.num_layers for i in feature_layers):
        raise UnsupportedModelError(
            f"vision_feature_layer {layers!r} is outside the tower's {config.num_layers} layers")
    if not 0 <= config.image_token_id < text.vocab_size:
        raise UnsupportedModelError("image_token_index is outside the language vocabulary")
    return text, config


def load_served_config(model_dir: str | Path) -> tuple[ModelConfig, VisionConfig | None]:
    """The language model's config of any checkpoint flare serves, and its vision
    tower's (None for a text-only checkpoint)."""
    raw, generation = read_config_json(model_dir)
    if is_vision_config(raw):
        return parse_vision_model_config(raw, generation)
    return parse_model_config(raw, generation), None
