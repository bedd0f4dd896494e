"""Image prompts served over HTTP by the real runtime (CPU backend, device process) on
a tiny random LLaVA checkpoint written with transformers (``vision_fixtures``: CLIP
tower, projector, Llama language model, norms randomised).

Greedy output of a chat with one image and with three images (prefill chunks of 64
tokens, so image positions span chunks) equals transformers' ``generate`` on the same
ids and the same preprocessed pixels, token for token; usage counts each image as
its expanded placeholder (as ``/tokenize`` does). A repeated image is served from the prefix cache (hit
tokens rise) with the same output; a different image with the same text never
matches it (its output is transformers' for that image). Bad image inputs get a 4xx
naming the field and the server keeps serving. Vision runs as scheduled frames of
its own (the catalog's vision programs, PRE-1), each measured by its own interval. On two
tensor-parallel ranks a chat gives transformers' output too.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import trio
from PIL import Image
from vision_fixtures import IMAGE_TOKEN, TOKENS_PER_IMAGE, build_llava

from actors.config import RuntimeConfig
from actors.public import RuntimeStatistics
from actors.system import open_runtime
from ops.testing import serve_app
from policy import GraphKind

NEW_TOKENS = 8
SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava("llava_llama", tmp_path_factory.mktemp("llava_http"))


def _image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _body(texts: list[str], urls: list[str]) -> dict[str, Any]:
    """One user message: ``texts[0]``, then each image followed by its text."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": texts[0]}]
    for url, text in zip(urls, texts[1:], strict=True):
        parts += [{"type": "image_url", "image_url": {"url": url}},
                  {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": parts}],
            "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": True}


def _reference_ids(texts: list[str], images: int) -> list[int]:
    """The ids flare's template and WordLevel tokenizer give: ``<user> text
    <image>... <assistant>`` with each image expanded to its placeholder run."""
    def words(text: str) -> list[int]:
        return [SPECIAL.get(w, int(w[1:]) if w[1:].isdigit() else 0) for w in text.split()]
    ids = words("<user> " + texts[0])
    for text in texts[1:images + 1]:
        ids += [IMAGE_TOKEN] * TOKENS_PER_IMAGE + words(text)
    return ids + words(" <assistant>")


def _hf_greedy(directory: Path, ids: list[int], images: list[Image.Image]) -> list[int]:
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = tf.LlavaForConditionalGeneration.from_pretrained(directory, dtype="float32").eval()
    pixels = CLIPImageProcessorPil.from_pretrained(directory)(
        images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        # an explicit mask: ids hold 0 (<unk>), which generate would take for padding
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _tokens(reply: dict[str, Any]) -> list[int]:
    return [SPECIAL.get(t["token"], int(t["token"][1:]) if t["token"][1:].isdigit() else -1)
            for t in reply["choices"][0]["logprobs"]["content"]]


async def _chat(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/v1/chat/completions", json=body)


async def test_image_chats_equal_transformers(llava: Path) -> None:
    images = [_image(i) for i in range(4)]
    urls = [_url(_png(i)) for i in images]
    one = ["w5 w6 w7", "w8 w9"]
    three = ["w11 w12 w21 w22 w23 w24 w25", "w13 w26", "w14 w15 w27", "w16 w17 w18"]
    config = RuntimeConfig(model_dir=llava, backend="cpu", max_batch=2,
                           prefill_capacities=(64,), page_size=16, max_context=256)
    with trio.fail_after(240):
        async with open_runtime(config) as runtime, serve_app(runtime) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            first = (await _chat(client, _body(one, urls[:1]))).json()
            hits = runtime.statistics().prefix_cache_hit_tokens
            repeat = (await _chat(client, _body(one, urls[:1]))).json()
            repeat_hits = runtime.statistics().prefix_cache_hit_tokens - hits
            other = (await _chat(client, _body(one, urls[3:4]))).json()
            triple = (await _chat(client, _body(three, urls[:3]))).json()
            tokenized = (await client.post("/tokenize", json={
                "messages": _body(three, urls[:3])["messages"],
                "add_generation_prompt": True})).json()
            vision = [t.shape for t in runtime.scheduler.traces()
                      if t.shape.kind is GraphKind.VISION]
            measured = {shape: runtime.scheduler.estimates.estimate_ns(shape)
                        for shape in vision}
    # PRE-1, PRE-18: vision ran as frames of its own, each measured by its own interval
    assert vision and all(ns > 0 for ns in measured.values())
    ids_one, ids_three = _reference_ids(one, 1), _reference_ids(three, 3)
    assert first["usage"]["prompt_tokens"] == len(ids_one)
    assert triple["usage"]["prompt_tokens"] == len(ids_three) > 64
    assert tokenized["tokens"] == ids_three  # /tokenize expands images the same way
    expected = _hf_greedy(llava, ids_one, images[:1])
    assert _tokens(first) == expected
    assert _tokens(repeat) == expected and repeat_hits >= 16
    other_expected = _hf_greedy(llava, ids_one, images[3:4])
    assert other_expected != expected  # the image decides the continuation
    assert _tokens(other) == other_expected
    assert _tokens(triple) == _hf_greedy(llava, ids_three, images[:3])


async def test_bad_image_inputs_are_4xx_and_serving_continues(llava: Path) -> None:
    good = _url(_png(_image(7)))
    big = Image.new("RGB", (4100, 4100), (10, 20, 30))
    cases = {
        "truncated": _url(_png(_image(8)))[:-40],
        "not an image": _url(b"plain text, not a picture"),
        "too many pixels": _url(_png(big)),
        "a URL": "https://example.com/cat.png",
    }
    config = RuntimeConfig(model_dir=llava, backend="cpu", max_batch=2,
                           prefill_capacities=(64,), page_size=16, max_context=256)
    with trio.fail_after(240):
        async with open_runtime(config) as runtime, serve_app(runtime) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            answers = {name: await _chat(client, _body(["w5", "w6"], [url]))
                       for name, url in cases.items()}
            answers["too many images"] = await _chat(
                client, _body(["w5", *["w6"] * 5], [good] * 5))
            after = await _chat(client, _body(["w5", "w6"], [good]))
    for name, response in answers.items():
        assert 400 <= response.status_code < 500, name
        assert "image_url" in response.json()["error"]["param"], name
    assert after.status_code == 200
    assert len(after.json()["choices"][0]["logprobs"]["content"]) == NEW_TOKENS


async def _served(llava: Path, window_images: int, bodies: list[dict[str, Any]]
                  ) -> tuple[list[httpx.Response], RuntimeStatistics, str]:
    """Without the prefix cache, so every request prefills all of its windows; with the
    statistics and the ``/metrics`` text after the last."""
    config = RuntimeConfig(model_dir=llava, backend="cpu", max_batch=2,
                           prefill_capacities=(64,), page_size=16, max_context=256,
                           vision_feature_images=window_images, prefix_caching=False)
    async with open_runtime(config) as runtime, serve_app(runtime) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        answers = [await _chat(client, body) for body in bodies]
        return answers, runtime.statistics(), (await client.get("/metrics")).text


async def test_three_images_over_one_image_windows_equal_transformers(llava: Path) -> None:
    """Covers PRE-26, PRE-27, PRE-28, PRE-30, PRE-31, PRE-33, PRE-34: with feature
    storage for one image (``--vision-feature-images 1``) the three images form three
    windows; each prompt frame asks only for its active window's image, prefill stops
    before the next window, and each of the two boundaries runs a window snapshot and
    its restore (a frame asking for an image outside its row generation's window fails
    its request). The logical request keeps its prompt, seed, sampling and usage across
    windows: greedy output equals transformers' and the single-window run's, and a
    seeded sampled request gives the same tokens and usage as with storage for all
    three images (one window, no snapshot)."""
    images = [_image(i) for i in range(3)]
    three = ["w11 w12 w21", "w13 w26", "w14 w15 w27", "w16"]
    greedy = _body(three, [_url(_png(i)) for i in images])
    sampled = {**greedy, "temperature": 1.0, "seed": 7}
    with trio.fail_after(300):
        windowed, windowed_stats, metrics = await _served(llava, 1, [sampled, greedy])
        whole, whole_stats, _ = await _served(llava, 8, [sampled, greedy])
    assert all(r.status_code == 200 for r in (*windowed, *whole)), windowed[0].text
    assert windowed_stats.window_snapshots == 4  # two boundaries per request
    assert whole_stats.window_snapshots == 0
    counted = [line for line in metrics.splitlines()
               if line.startswith("flare_window_snapshots_total")]
    assert len(counted) == 1 and counted[0].endswith(" 4.0")
    ids = _reference_ids(three, 3)
    assert len(ids) <= 64  # one chunk would hold it: the windows split it
    assert _tokens(windowed[1].json()) == _hf_greedy(llava, ids, images)
    assert _tokens(windowed[1].json()) == _tokens(whole[1].json())
    assert _tokens(windowed[0].json()) == _tokens(whole[0].json())
    assert windowed[0].json()["usage"] == whole[0].json()["usage"]
    assert windowed[0].json()["usage"]["prompt_tokens"] == len(ids)


async def test_an_image_chat_on_two_tensor_parallel_ranks_equals_transformers(
        llava: Path) -> None:
    """OPEN-37: a vision checkpoint on two ranks (``-tp 2``): each rank reads its shard
    of the language model under the checkpoint's own tensor names, and the chat's
    greedy output equals transformers'."""
    images = [_image(5)]
    one = ["w5 w6 w7", "w8 w9"]
    config = RuntimeConfig(model_dir=llava, backend="cpu", max_batch=2,
                           prefill_capacities=(64,), page_size=16, max_context=256,
                           tensor_parallel_size=2, capture_forward=False)
    with trio.fail_after(240):
        async with open_runtime(config) as runtime, serve_app(runtime) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            reply = await _chat(client, _body(one, [_url(_png(images[0]))]))
    assert reply.status_code == 200, reply.text
    assert _tokens(reply.json()) == _hf_greedy(llava, _reference_ids(one, 1), images)
