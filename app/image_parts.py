"""Image content parts of chat messages: ``{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`` (PNG, JPEG, WebP, GIF), checked against ``ImageLimits``.

Owns the decoding of ``data:`` URLs (strict base64, payload bytes, the image itself
through Pillow, pixel count) and the refusal of remote URLs: flare fetches nothing, so
an ``http(s)`` URL is a 400 naming the field, whether or not its domain is allowed.
Every refusal is a 4xx whose ``param`` is ``messages[i].content[j].image_url``. An
accepted part becomes an ``ImageInput`` (decoded image plus a digest of its pixels,
the identity a prefix cache keys on); the message text holds ``IMAGE_PLACEHOLDER`` in
its place.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from PIL import Image, UnidentifiedImageError

from actors import ImagePrompting, ImageSpan
from app.errors import ApiError, bad_request

IMAGE_PLACEHOLDER = "<image>"
"""What an image part becomes in the rendered message text (LLaVA's convention)."""
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""Encodings accepted (GIF: its first frame)."""
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp|gif);base64,(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageLimits:
    """Bounds on the images of one request."""

    max_images: int = 4
    """Images per request (``--limit-mm-per-prompt`` style)."""
    max_pixels: int = 4096 * 4096
    """Width times height of one decoded image."""
    max_bytes: int = 8 << 20
    """Decoded payload bytes of one image."""
    allowed_domains: tuple[str, ...] = ()
    """Domains a remote URL may name; fetching is not built, so they are still refused,
    with a message saying so."""


DEFAULT_IMAGE_LIMITS = ImageLimits()


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageInput:
    """One accepted image, in request order."""

    field: str
    """``messages[i].content[j].image_url``: what an error about it names."""
    image: Image.Image
    digest: str
    """sha256 of the RGB pixels and size: equal images have equal digests whatever
    their encoding."""


def _too_large(message: str, field: str) -> ApiError:
    return ApiError(413, message, param=field, code="image_too_large")


def pixel_digest(image: Image.Image) -> str:
    rgb = image.convert("RGB")
    return hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).hexdigest()


def decode_image(data: bytes, field: str, limits: ImageLimits) -> Image.Image:
    """The fully decoded image of ``data``: a 400 if it is truncated, not an image or
    in an encoding outside ``IMAGE_FORMATS``, a 413 past ``limits.max_pixels`` (checked
    from the header, before the pixels are decoded)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in IMAGE_FORMATS:
                raise bad_request(f"{field}: image encoding {image.format} is not supported; "
                                  "flare accepts " + ", ".join(IMAGE_FORMATS), param=field)
            if image.width * image.height > limits.max_pixels:
                raise _too_large(f"{field}: the image is {image.width}x{image.height}; at "
                                 f"most {limits.max_pixels} pixels are accepted.", field)
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise _too_large(f"{field}: the image has too many pixels.", field) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise bad_request(f"{field}: the data is not a complete image ({exc}).",
                          param=field) from None
    return image


def _remote(url: str, field: str, limits: ImageLimits) -> ApiError:
    host = (urlsplit(url).hostname or "").lower()
    if host in limits.allowed_domains:
        return bad_request(f"{field}: fetching remote images is not supported; send the image "
                           "inline as a data: URL.", param=field)
    return bad_request(f"{field}: remote image URLs are refused (flare fetches nothing unless "
                       "--allowed-media-domains lists the domain); send the image inline as "
                       "a data:image/...;base64 URL.", param=field)


def parse_image_part(part: dict[str, Any], field: str, limits: ImageLimits,
                     count: int) -> ImageInput:
    """The image of one ``image_url`` part; ``count`` images came before it."""
    if count >= limits.max_images:
        raise bad_request(f"{field}: at most {limits.max_images} images are accepted per "
                          "request.", param=field)
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise bad_request(f"{field} must be an object with a string 'url'.", param=field)
    if url.startswith(("http://", "https://")):
        raise _remote(url, field, limits)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise bad_request(f"{field}: the url must be a data:image/<png|jpeg|webp|gif>;base64,"
                          "... URL.", param=field)
    payload = match.group(2)
    if len(payload) > (limits.max_bytes * 4) // 3 + 4:
        raise _too_large(f"{field}: the image is over {limits.max_bytes} bytes.", field)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{field}: the data URL is not valid base64.", param=field) from None
    if len(data) > limits.max_bytes:
        raise _too_large(f"{field}: the image is over {limits.max_bytes} bytes.", field)
    image = decode_image(data, field, limits)
    return ImageInput(field=field, image=image, digest=pixel_digest(image))


def image_spans(images: Sequence[ImageInput], starts: Sequence[int],
                prompting: ImagePrompting | None) -> tuple[ImageSpan, ...]:
    """The prompt's image spans: image ``k`` at the ``k``-th expanded placeholder. A
    rendering with another number of placeholders (text holding a literal
    ``IMAGE_PLACEHOLDER``, or a template that drops content) is a 400."""
    if not images or prompting is None:
        return ()
    if len(starts) != len(images):
        raise bad_request(f"the rendered prompt holds {len(starts)} image placeholders for "
                          f"{len(images)} images; message text must not contain "
                          f"{IMAGE_PLACEHOLDER!r}.", param="messages")
    return tuple(ImageSpan(digest=image.digest, image=image.image, start=start,
                           tokens=prompting.tokens_per_image)
                 for image, start in zip(images, starts, strict=True))
