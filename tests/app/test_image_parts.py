"""Image content parts of chat messages: ``data:`` URLs decode to images with a pixel
digest; every bad input is a 4xx naming ``messages[i].content[j].image_url``
(truncated or invalid base64, not an image, an unsupported encoding, too many bytes,
too many pixels, too many images, a remote URL whether or not its domain is allowed),
and a well-formed image is refused with a 400 naming its field, since no served
program reads image features.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from app.errors import ApiError
from app.image_parts import IMAGE_PLACEHOLDER, ImageLimits, parse_image_part
from app.request_parsing import parse_chat

FIELD = "messages[0].content[1].image_url"


def _encoded(size: tuple[int, int] = (12, 8), fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _part(data: bytes, mime: str = "png") -> dict[str, object]:
    return {"type": "image_url",
            "image_url": {"url": f"data:image/{mime};base64," + base64.b64encode(data).decode()}}


def _error(part: dict[str, object], limits: ImageLimits | None = None, count: int = 0
           ) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_image_part(part, FIELD, limits or ImageLimits(), count)
    assert info.value.param == FIELD
    return info.value


@pytest.mark.parametrize(("fmt", "mime"), [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp")])
def test_data_urls_decode(fmt: str, mime: str) -> None:
    image = parse_image_part(_part(_encoded(fmt=fmt), mime), FIELD, ImageLimits(), 0)
    assert image.image.size == (12, 8) and image.field == FIELD


def test_digest_keys_the_pixels_not_the_encoding() -> None:
    """The same pixels in PNG and WebP (lossless) share a digest; other pixels do not."""
    png = _encoded(seed=1)
    webp = io.BytesIO()
    Image.open(io.BytesIO(png)).save(webp, format="WEBP", lossless=True)
    a = parse_image_part(_part(png), FIELD, ImageLimits(), 0)
    b = parse_image_part(_part(webp.getvalue(), "webp"), FIELD, ImageLimits(), 0)
    c = parse_image_part(_part(_encoded(seed=2)), FIELD, ImageLimits(), 0)
    assert a.digest == b.digest != c.digest


def test_bad_inputs_are_4xx_naming_the_field() -> None:
    png = _encoded(size=(40, 30))
    url = _part(png)["image_url"]["url"]  # type: ignore[index]
    assert _error({"type": "image_url", "image_url": {"url": url[:-9]}}).status == 400  # truncated
    assert _error({"type": "image_url", "image_url": {"url": url + "!"}}).status == 400
    assert _error(_part(b"plain text, not an image")).status == 400
    assert _error(_part(png[: len(png) // 2])).status == 400  # truncated image data
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, format="BMP")
    assert "BMP" in _error(_part(bmp.getvalue())).message
    assert _error(_part(png), ImageLimits(max_bytes=len(png) - 1)).status == 413
    assert _error(_part(png), ImageLimits(max_pixels=40 * 30 - 1)).status == 413
    assert parse_image_part(_part(png), FIELD, ImageLimits(max_pixels=40 * 30), 0)
    assert "at most 2 images" in _error(_part(png), ImageLimits(max_images=2), count=2).message
    assert _error({"type": "image_url", "image_url": {}}).status == 400
    assert _error({"type": "image_url", "image_url": "data:text/plain;base64,aGk="}).status == 400


def test_remote_urls_are_refused_allowed_domain_or_not() -> None:
    """flare fetches nothing: an unlisted domain is refused naming the opt-in flag, a
    listed one is refused saying fetching is not supported."""
    part = {"type": "image_url", "image_url": {"url": "https://images.example/cat.png"}}
    assert "--allowed-media-domains" in _error(part).message
    listed = _error(part, ImageLimits(allowed_domains=("images.example",))).message
    assert "fetching remote images is not supported" in listed


def _chat(*content: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": list(content)}]}


def test_chat_with_an_image_names_its_field() -> None:
    """A well-formed image part parses into the message's images, standing as the
    placeholder in its text; a bad one after it in a later message names that one's
    field; text parts alone parse as before."""
    text = {"type": "text", "text": "look: "}
    message = parse_chat(_chat(text, _part(_encoded()))).messages[0]
    assert message.content == "look: " + IMAGE_PLACEHOLDER
    assert len(message.images) == 1 and message.images[0].field == FIELD
    with pytest.raises(ApiError) as info:
        parse_chat({"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [text, text, _part(b"nope")]}]})
    assert info.value.param == "messages[1].content[2].image_url"
    assert parse_chat(_chat(text, text)).messages[0].content == "look: look: "


@pytest.mark.parametrize(("flag", "images"), [("2", 2), ('{"image": 1}', 1), ("0", 0)])
def test_image_flags_reach_the_settings(flag: str, images: int) -> None:
    """``--limit-mm-per-prompt`` (N or vLLM's JSON form) and ``--allowed-media-domains``
    set the chat parser's limits: with them, the image past the limit is refused and
    a listed domain's URL is refused saying fetching is not supported."""
    from ops import cli
    from ops.run_command import build_app_settings

    argv = ["run", "--limit-mm-per-prompt", flag, "--allowed-media-domains", "Images.Example"]
    limits = build_app_settings(cli.build_parser(argv).parse_args(argv)).image_limits
    assert limits.max_images == images and limits.allowed_domains == ("images.example",)
    parts = [_part(_encoded(seed=k)) for k in range(images + 1)]
    with pytest.raises(ApiError) as info:
        parse_chat(_chat(*parts), limits)
    assert info.value.param == f"messages[0].content[{images}].image_url"
    assert f"at most {images} images" in info.value.message
    remote = {"type": "image_url", "image_url": {"url": "https://images.example/a.png"}}
    expected = "fetching remote images is not supported" if images else "at most 0 images"
    with pytest.raises(ApiError, match=expected):
        parse_chat(_chat(remote), limits)


@pytest.mark.parametrize("flag", ["-1", "many", '{"image": "2"}', "true"])
def test_bad_image_limit_flag_is_refused(flag: str) -> None:
    from ops import cli

    argv = ["run", "--limit-mm-per-prompt", flag]
    with pytest.raises(SystemExit):
        cli.build_parser(argv).parse_args(argv)
