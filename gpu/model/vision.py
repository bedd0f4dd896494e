"""The vision tower forward: CLIP-style encoder plus LLaVA's projector.

Owns the math that turns preprocessed pixels ``[images, channels, H, W]`` into image
feature tokens ``[images, tokens_per_image, text_hidden]`` in the language model's
embedding space: patch embedding (a strided convolution), the class embedding,
learned position embeddings, the pre-layernorm, the encoder layers (bidirectional
attention, ``quick_gelu``/``gelu`` MLP), the selected hidden layers and the
linear-act-linear projector. It holds no per-request state and never touches the
KV cache; the decoder reads its output through ``PackedBatch.image_features``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from gpu.model.image_processor import ImageProcessorConfig, parse_image_processor_config, preprocess
from gpu.model.vision_config import VisionConfig


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# named functions, not lambdas: the tower travels to the device process by pickling
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class VisionTower:
    """Weights (names as ``gpu.model.vision_weights`` maps them) plus the forward."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], *,
                 processor: ImageProcessorConfig | None = None) -> None:
        self.config = config
        self.w = weights
        self.processor = processor or parse_image_processor_config({}, config.image_size)
        self._act = _ACTIVATIONS[config.hidden_act]
        self._projector_act = _ACTIVATIONS[config.projector_act]

    def pixels(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """Preprocessed pixel values ``[images, channels, H, W]`` (``encode``'s input)."""
        return torch.from_numpy(np.stack([preprocess(i, self.processor) for i in images]))

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[f"{name}.weight"], self.w[f"{name}.bias"],
                            self.config.layer_norm_eps)

    def _embeddings(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = F.conv2d(pixels, self.w["embeddings.patch_embedding.weight"],
                           stride=self.config.patch_size)
        patches = patches.flatten(2).transpose(1, 2)  # [B, patches, hidden]
        cls = self.w["embeddings.class_embedding"].expand(pixels.shape[0], 1, -1)
        h = torch.cat((cls, patches), dim=1)
        return h + self.w["embeddings.position_embedding.weight"][None, : h.shape[1]]

    def _encoder_layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        heads = self.config.num_heads
        x = self._norm(h, f"encoder.layers.{i}.layer_norm1")
        q, k, v = (self._linear(x, f"encoder.layers.{i}.self_attn.{p}_proj")
                   .view(b, t, heads, d // heads).transpose(1, 2) for p in ("q", "k", "v"))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        h = h + self._linear(attn, f"encoder.layers.{i}.self_attn.out_proj")
        x = self._norm(h, f"encoder.layers.{i}.layer_norm2")
        x = self._act(self._linear(x, f"encoder.layers.{i}.mlp.fc1"))
        return h + self._linear(x, f"encoder.layers.{i}.mlp.fc2")

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Image features ``[images, tokens_per_image, text_hidden]`` of pixel values
        ``[images, channels, image_size, image_size]`` (already preprocessed)."""
        cfg = self.config
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != expected:
            raise ValueError(f"pixel values must be [images, {expected}], got "
                             f"{tuple(pixels.shape)}")
        weight = self.w["embeddings.patch_embedding.weight"]
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        h = self._norm(self._embeddings(pixels), "pre_layrnorm")
        wanted = {i % (cfg.num_layers + 1) for i in cfg.feature_layers}
        kept = {0: h} if 0 in wanted else {}
        for i in range(max(wanted)):
            h = self._encoder_layer(i, h)
            if i + 1 in wanted:
                kept[i + 1] = h
        selected = torch.cat([kept[i % (cfg.num_layers + 1)] for i in cfg.feature_layers],
                             dim=-1)
        if not cfg.keep_class_token:
            selected = selected[:, 1:]
        x = self._projector_act(self._linear(selected, "multi_modal_projector.linear_1"))
        return self._linear(x, "multi_modal_projector.linear_2")
