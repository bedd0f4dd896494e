"""Image preprocessing as the checkpoint's ``preprocessor_config.json`` describes it
(``CLIPImageProcessor``): convert to RGB over white, resize (shortest edge, or an
exact height and width) with Pillow's filter, center crop, rescale and normalise with
the checkpoint's mean and standard deviation, channels first.

Owns the pixel arithmetic over decoded Pillow images (decoding request bytes is
``app.image_parts``'s); it loads no torch and reads only the checkpoint directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageProcessorConfig:
    """What ``preprocess`` does, from ``preprocessor_config.json``."""

    shortest_edge: int | None
    """Resize so the shorter side is this long (aspect kept); None: ``resize_to``."""
    resize_to: tuple[int, int] | None
    """Resize to exactly (height, width) when ``shortest_edge`` is None."""
    crop: tuple[int, int] | None
    """Center crop (height, width); None: no crop."""
    resample: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    convert_rgb: bool


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, dict):
        return int(value["height"]), int(value["width"])
    return int(value), int(value)


def parse_image_processor_config(raw: dict[str, Any], image_size: int) -> ImageProcessorConfig:
    """A config from a parsed ``preprocessor_config.json`` (CLIP's defaults at
    ``image_size`` for what it leaves out)."""
    size = raw.get("size", {"shortest_edge": image_size})
    shortest = size.get("shortest_edge") if isinstance(size, dict) else int(size)
    resize = raw.get("do_resize", True)
    crop = raw.get("crop_size", {"height": image_size, "width": image_size})
    return ImageProcessorConfig(
        shortest_edge=int(shortest) if resize and shortest is not None else None,
        resize_to=_pair(size) if resize and shortest is None else None,
        crop=_pair(crop) if raw.get("do_center_crop", True) else None,
        resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
        rescale_factor=float(raw.get("rescale_factor", 1 / 255))
        if raw.get("do_rescale", True) else None,
        mean=tuple(raw.get("image_mean", CLIP_MEAN)) if raw.get("do_normalize", True) else None,
        std=tuple(raw.get("image_std", CLIP_STD)) if raw.get("do_normalize", True) else None,
        convert_rgb=bool(raw.get("do_convert_rgb", True)),
    )


def load_image_processor_config(model_dir: str | Path, image_size: int) -> ImageProcessorConfig:
    """The checkpoint's ``preprocessor_config.json``, or CLIP's defaults without one."""
    path = Path(model_dir) / "preprocessor_config.json"
    raw = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    return parse_image_processor_config(raw, image_size)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _resized(image: Image.Image, config: ImageProcessorConfig) -> Image.Image:
    if config.shortest_edge is not None:
        width, height = image.size
        short, long = sorted((height, width))
        new_long = int(config.shortest_edge * long / short)
        size = (config.shortest_edge, new_long) if height <= width else \
            (new_long, config.shortest_edge)
        height, width = size
    elif config.resize_to is not None:
        height, width = config.resize_to
    else:
        return image
    return image.resize((width, height), resample=Image.Resampling(config.resample))


def preprocess(image: Image.Image, config: ImageProcessorConfig) -> np.ndarray:
    """Pixel values ``float32 [channels, height, width]`` of one decoded image."""
    if config.convert_rgb:
        image = _to_rgb(image)
    image = _resized(image, config)
    if config.crop is not None:
        crop_h, crop_w = config.crop
        top, left = (image.height - crop_h) // 2, (image.width - crop_w) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
    pixels = np.asarray(image, dtype=np.float64)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if config.rescale_factor is not None:
        pixels = pixels * config.rescale_factor
    if config.mean is not None and config.std is not None:
        pixels = (pixels - np.asarray(config.mean)) / np.asarray(config.std)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)
