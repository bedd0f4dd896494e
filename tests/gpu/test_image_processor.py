"""Image preprocessing against transformers' CLIP image processor (its Pillow backend,
``CLIPImageProcessorPil``: the same resize filter flare uses) on random images of
several sizes, aspect ratios and modes (RGB, RGBA over white, greyscale, palette with
transparency), for a shortest-edge and an exact-size config: pixel values agree within
1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from gpu.model.image_processor import parse_image_processor_config, preprocess

CONFIGS = {
    "shortest_edge": dict(size={"shortest_edge": 40}, crop_size={"height": 36, "width": 36},
                          image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3]),
    "exact": dict(size={"height": 24, "width": 30}, do_center_crop=False, resample=2),
}


def _image(mode: str, size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    width, height = size
    if mode == "L":
        return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
    if mode == "P":
        image = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        image = image.convert("P")
        image.info["transparency"] = 7
        return image
    channels = 4 if mode == "RGBA" else 3
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("mode", "size"), [("RGB", (64, 48)), ("RGB", (37, 91)),
                                            ("RGBA", (50, 50)), ("L", (120, 33)),
                                            ("P", (45, 60))])
def test_preprocess_equals_transformers(name: str, mode: str, size: tuple[int, int]) -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    raw = CONFIGS[name]
    image = _image(mode, size, seed=sum(size))
    expected = CLIPImageProcessorPil(**raw)(image.copy(), return_tensors="np")["pixel_values"][0]
    got = preprocess(image, parse_image_processor_config(raw, image_size=36))
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-5
