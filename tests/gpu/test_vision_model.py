"""The LLaVA family against transformers, on tiny random checkpoints the tests write
(``vision_fixtures``: a CLIP vision tower, the projector and a Llama or Qwen2 language
model; norms and biases randomised).

Image features (projector output) equal transformers' ``get_image_features`` within
1e-4 for both feature selections (one layer without the class token; two layers
concatenated with it), and greedy tokens of a prompt holding images equal
transformers' ``generate`` token for token. Loading reads both checkpoint layouts and
refuses what it cannot run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import PAGE_SIZE, build_engine, prompt_of
from safetensors.torch import load_file, save_file
from vision_fixtures import (
    IMAGE_SIZE,
    IMAGE_TOKEN,
    LLAVA_KINDS,
    TOKENS_PER_IMAGE,
    build_llava,
    reference_greedy,
)

from gpu.model.config import ModelLoadError, UnsupportedModelError
from gpu.model.vision_config import load_served_config, parse_vision_model_config

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {kind: build_llava(kind, root / kind) for kind in LLAVA_KINDS}


def _hf(directory: Path):  # type: ignore[no-untyped-def]
    import transformers as tf

    return tf.LlavaForConditionalGeneration.from_pretrained(directory, dtype="float32").eval()


def _pixels(images: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)


def _hf_features(model, pixels: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = model.get_image_features(
            pixel_values=pixels, vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy)
    return torch.stack(list(out.pooler_output))


def _image_prompt(images: int, seed: int, tokens_per_image: int) -> list[int]:
    prompt = [1, *prompt_of(5, seed, vocab=80)]
    for i in range(images):
        prompt += [IMAGE_TOKEN] * tokens_per_image + prompt_of(3, seed + i + 1, vocab=80)
    return prompt


@pytest.mark.parametrize("kind", sorted(LLAVA_KINDS))
def test_image_features_equal_transformers(kind: str, llava: dict[str, Path]) -> None:
    """The projector output of flare's vision tower equals transformers' for a batch of
    three images, within 1e-4."""
    engine = build_engine(llava[kind])
    assert engine.vision is not None
    pixels = _pixels(3, seed=1)
    expected = _hf_features(_hf(llava[kind]), pixels)
    got = engine.vision.encode(pixels)
    assert got.shape == expected.shape == (3, engine.vision.config.tokens_per_image,
                                           engine.config.hidden_size)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", sorted(LLAVA_KINDS))
@pytest.mark.parametrize("images", [1, 3])
def test_image_prompt_greedy_equals_generate(kind: str, images: int,
                                             llava: dict[str, Path]) -> None:
    """Image features in place of the placeholder embeddings, then greedy decoding,
    equal transformers' ``generate`` on the same ids and pixels for 16 tokens; a
    different image changes the continuation (the features are really read)."""
    engine = build_engine(llava[kind])
    assert engine.vision is not None
    prompt = _image_prompt(images, seed=4, tokens_per_image=engine.vision.config.tokens_per_image)
    pixels = _pixels(images, seed=9)
    model = _hf(llava[kind])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), pixel_values=pixels,
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                             eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    features = engine.vision.encode(pixels).reshape(-1, engine.config.hidden_size)
    got = reference_greedy(engine.parts.decoder, prompt, features, NEW_TOKENS,
                           page_size=PAGE_SIZE)
    assert got == expected
    other = engine.vision.encode(_pixels(images, seed=10)).reshape(-1, engine.config.hidden_size)
    assert reference_greedy(engine.parts.decoder, prompt, other, NEW_TOKENS) != expected


def test_captured_decoder_reads_image_features(llava: dict[str, Path]) -> None:
    """With forward capture on, a forward carrying image features still reads them
    (it runs eagerly), so the greedy tokens are those of the uncaptured decoder."""
    engine = build_engine(llava["llava_llama"])
    assert engine.vision is not None
    prompt = _image_prompt(1, seed=6, tokens_per_image=TOKENS_PER_IMAGE)
    features = engine.vision.encode(_pixels(1, seed=2)).reshape(-1, engine.config.hidden_size)
    expected = reference_greedy(engine.parts.decoder, prompt, features, 8)
    engine.parts.decoder.enable_capture()
    assert reference_greedy(engine.parts.decoder, prompt, features, 8) == expected


def test_nested_checkpoint_layout_loads_the_same_tower(llava: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """A checkpoint in transformers' nested layout (``model.vision_tower.vision_model.*``,
    ``model.language_model.*``, ``lm_head.*``) loads to the same features."""
    source = llava["llava_llama"]
    tensors = load_file(str(source / "model.safetensors"))
    renames = (("vision_tower.", "model.vision_tower.vision_model."),
               ("multi_modal_projector.", "model.multi_modal_projector."),
               ("language_model.model.", "model.language_model."),
               ("language_model.lm_head.", "lm_head."))
    nested = {}
    for name, tensor in tensors.items():
        prefix, new = next(p for p in renames if name.startswith(p[0]))
        nested[new + name[len(prefix):]] = tensor
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    save_file(nested, str(tmp_path / "model.safetensors"))
    pixels = _pixels(2, seed=3)
    a, b = build_engine(source).vision, build_engine(tmp_path).vision
    assert a is not None and b is not None
    assert torch.equal(a.encode(pixels), b.encode(pixels))


def test_text_checkpoint_has_no_vision_tower(tiny_checkpoints: dict[str, Path]) -> None:
    """A text-only checkpoint loads as before, with no vision tower."""
    config, vision = load_served_config(tiny_checkpoints["llama"])
    assert vision is None and config.architecture == "LlamaForCausalLM"
    assert build_engine(tiny_checkpoints["llama"]).vision is None


def test_vision_config_geometry_and_refusals(llava: dict[str, Path]) -> None:
    """The parsed geometry follows the checkpoint; options flare cannot run are refused
    with a message naming the option, and a missing tensor is a load error."""
    raw = json.loads((llava["llava_llama"] / "config.json").read_text())
    text, vision = parse_vision_model_config(raw)
    assert text.architecture == "LlamaForCausalLM"
    assert vision.tokens_per_image == TOKENS_PER_IMAGE and vision.image_token_id == IMAGE_TOKEN
    full = parse_vision_model_config({**raw, "vision_feature_select_strategy": "full"})[1]
    assert full.tokens_per_image == TOKENS_PER_IMAGE + 1
    for change, word in (({"vision_feature_select_strategy": "pooled"}, "select_strategy"),
                         ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
                         ({"vision_feature_layer": -9}, "vision_feature_layer"),
                         ({"text_config": {**raw["text_config"], "model_type": "phi"}},
                          "model_type")):
        with pytest.raises(UnsupportedModelError, match=word):
            parse_vision_model_config({**raw, **change})
    with pytest.raises(ModelLoadError, match="lacks"):
        from gpu.model.vision_weights import load_vision_weights

        tensors = load_file(str(llava["llava_llama"] / "model.safetensors"))
        del tensors["multi_modal_projector.linear_2.weight"]
        broken = llava["llava_llama"].parent / "broken"
        broken.mkdir(exist_ok=True)
        save_file(tensors, str(broken / "model.safetensors"))
        load_vision_weights(broken, text, vision, device="cpu", dtype=torch.float32)


def test_engine_preprocesses_with_the_checkpoint_config(llava: dict[str, Path]) -> None:
    """The engine's tower preprocesses with the checkpoint's ``preprocessor_config.json``
    (its mean and std, not CLIP's defaults), as transformers' processor loaded from the
    same directory does."""
    import numpy as np
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    engine = build_engine(llava["llava_llama"])
    assert engine.vision is not None
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((50, 70), (90, 40))]
    expected = CLIPImageProcessorPil.from_pretrained(llava["llava_llama"])(
        images, return_tensors="np")["pixel_values"]
    got = engine.vision.pixels(images)
    assert got.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert np.abs(got.numpy() - expected).max() <= 1e-5
