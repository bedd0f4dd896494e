"""``--max-image-bytes`` and ``--max-image-pixels`` set the image limits of the chat
parser (``ImageLimits``): under a small value, an image past it is a 413
``image_too_large`` naming its part, over HTTP; a non-positive value is a start-up
error naming the flag."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server
from PIL import Image

from actors.config import ConfigError
from app import AppSettings
from app.image_parts import DEFAULT_IMAGE_LIMITS
from ops import cli
from ops.run_command import build_app_settings


def _settings(*flags: str) -> AppSettings:
    argv = ["run", *flags]
    return build_app_settings(cli.build_parser(argv).parse_args(argv))


def _png(width: int, height: int) -> str:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_flags_default_to_the_image_limits_defaults() -> None:
    limits = _settings().image_limits
    assert (limits.max_bytes, limits.max_pixels) == (DEFAULT_IMAGE_LIMITS.max_bytes,
                                                     DEFAULT_IMAGE_LIMITS.max_pixels)


@pytest.mark.parametrize(("flags", "limit"), [
    (["--max-image-bytes", "2000"], "2000 bytes"),
    (["--max-image-pixels", "1000"], "1000 pixels")])
async def test_an_image_past_a_flag_is_a_413_naming_its_part(
        codec: TinyCodec, flags: list[str], limit: str) -> None:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url", "image_url": {"url": _png(40, 40)}}]}]}
    with trio.fail_after(20):
        async with running_server(FakeRuntime(codec), _settings(*flags)) as server, \
                client_for(server) as client:
            answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["code"] == "image_too_large"
    assert error["param"] == "messages[1].content[1].image_url"
    assert limit in error["message"]


@pytest.mark.parametrize("flag", ["--max-image-bytes", "--max-image-pixels"])
def test_a_non_positive_limit_is_refused_naming_the_flag(flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        _settings(flag, "0")
