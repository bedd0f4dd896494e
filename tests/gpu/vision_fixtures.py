"""Tiny random LLaVA-style checkpoints the vision tests write with transformers'
own classes (``LlavaConfig`` over a small ``CLIPVisionConfig`` and a Llama or Qwen2
``text_config``), plus a one-lane reference loop that drives flare's decoder with
image features in place of the placeholder tokens' embeddings.

Norm weights and biases are randomised (``variant_fixtures``); the language model's
matrices use a large spread so greedy continuations are free of near-ties.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from model_fixtures import VOCAB, _common, _write_tokenizer
from variant_fixtures import randomise_norms_and_biases

from gpu.model.batch import PackedBatch
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import CacheGeometry, PagedKVCache

IMAGE_TOKEN = 90
"""The placeholder id (``image_token_index``), inside the tiny vocabulary."""
IMAGE_SIZE, PATCH = 32, 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2  # "default" strategy drops the class token

LLAVA_KINDS: dict[str, dict[str, object]] = {
    "llava_llama": dict(text="llama", vision_act="quick_gelu", feature_layer=-2,
                        strategy="default"),
    "llava_qwen2": dict(text="qwen2", vision_act="gelu", feature_layer=[-1, 1],
                        strategy="full"),
}


def build_llava(kind: str, directory: Path) -> Path:
    """Write the ``kind`` checkpoint (``LLAVA_KINDS``) and a tokenizer into ``directory``."""
    import transformers as tf

    spec = LLAVA_KINDS[kind]
    torch.manual_seed(len(kind))
    vision = tf.CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=3,
                                 num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                                 hidden_act=spec["vision_act"], projection_dim=16)
    text_cls = tf.LlamaConfig if spec["text"] == "llama" else tf.Qwen2Config
    text = text_cls(**_common(tie_word_embeddings=False))
    config = tf.LlavaConfig(vision_config=vision, text_config=text,
                            image_token_index=IMAGE_TOKEN, image_seq_length=TOKENS_PER_IMAGE,
                            vision_feature_layer=spec["feature_layer"],
                            vision_feature_select_strategy=spec["strategy"])
    model = tf.LlavaForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "language_model" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif param.dim() == 2 and "projector" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    randomise_norms_and_biases(model, seed=5, gemma=False)
    model.save_pretrained(directory)
    _write_tokenizer(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": IMAGE_SIZE},
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "image_mean": [0.5, 0.45, 0.4], "image_std": [0.25, 0.26, 0.27]}))
    assert config.text_config.vocab_size == VOCAB
    return directory


def image_positions(prompt: list[int]) -> torch.Tensor:
    return torch.tensor([i for i, t in enumerate(prompt) if t == IMAGE_TOKEN])


def reference_greedy(decoder: Decoder, prompt: list[int], features: torch.Tensor,
                     new_tokens: int, *, page_size: int = 16) -> list[int]:
    """Greedy tokens of one lane: the whole prompt in one forward (image feature rows
    ``features [M, hidden]`` at the placeholder positions), then one token a forward."""
    total = len(prompt) + new_tokens
    geometry = CacheGeometry(page_size=page_size, num_pages=-(-total // page_size),
                             max_context=total)
    cache = PagedKVCache(decoder.config, geometry, device="cpu", dtype=decoder.dtype)
    table = torch.arange(geometry.blocks_per_row)[None]

    def forward(tokens: list[int], start: int, image: tuple[torch.Tensor, torch.Tensor] | None
                ) -> int:
        positions = torch.arange(start, start + len(tokens))
        batch = PackedBatch(token_ids=torch.tensor(tokens), positions=positions,
                            write_slots=positions, token_lane=torch.zeros_like(positions),
                            lane_block_tables=table, image_features=image)
        hidden = decoder.forward(batch, cache)
        return int(decoder.logits(hidden[-1:]).argmax(-1))

    out = [forward(prompt, 0, (image_positions(prompt), features))]
    while len(out) < new_tokens:
        out.append(forward([out[-1]], len(prompt) + len(out) - 1, None))
    return out
