"""The prepared vision program and prompt programs that read image features.

Prefill chunks (one splitting an image's positions) and a mixed frame whose prompt
lane sits after a decode lane (a nonzero packed offset) read each image's features at
its positions: the greedy tokens equal the one-lane reference with the features in
place. Feature storage is keyed by the pixel digest: a repeated image is not
re-encoded, a different one is, and storage keeps at most its bound. A window
snapshot's restore starts a fresh row generation whose features sit at compact offsets
from zero (PRE-33).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import DECODE, MIXED_2, PREFILL_64, build_engine, prompt_of
from PIL import Image
from vision_fixtures import IMAGE_TOKEN, TOKENS_PER_IMAGE, build_llava, reference_greedy

from gpu.frames import (
    RESULT_KEY,
    FrameError,
    ImageSpan,
    PrefillFrame,
    RowCopy,
    StateOpResult,
    StateUpdate,
    StepResult,
    VisionFrame,
    as_inputs,
)
from gpu.programs.driver import ReferenceDriver, RowMirror
from gpu.programs.vision import VisionProgram, chunk_images

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava("llava_llama", tmp_path_factory.mktemp("llava_program"))


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))


def _prompt_and_spans(seeds: list[int]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    prompt = [1, *prompt_of(5, 3, vocab=80)]
    spans = []
    for i, seed in enumerate(seeds):
        spans.append(ImageSpan(digest=f"d{seed}", image=_image(seed), start=len(prompt),
                               tokens=TOKENS_PER_IMAGE))
        prompt += [IMAGE_TOKEN] * TOKENS_PER_IMAGE + prompt_of(3, 7 + i, vocab=80)
    return prompt, tuple(spans)


def _expected(engine, prompt: list[int], spans: tuple[ImageSpan, ...]) -> list[int]:  # type: ignore[no-untyped-def]
    pixels = engine.vision.pixels([s.image for s in spans])
    features = engine.vision.encode(pixels).reshape(-1, engine.config.hidden_size)
    return reference_greedy(engine.parts.decoder, prompt, features, NEW_TOKENS)


def _prefill(driver: ReferenceDriver, prompt: list[int], spans: tuple[ImageSpan, ...],
             chunk: int) -> int:
    updates = (driver.init_row(0),)
    token = -1
    for start in range(0, len(prompt), chunk):
        piece = tuple(prompt[start:start + chunk])
        end = start + len(piece)
        updates += driver.pages_for(0, end)
        result = driver.run(PREFILL_64, PrefillFrame(
            row=0, tokens=piece, start_position=start, ends_prompt=end == len(prompt),
            updates=updates, images=spans))
        updates = ()
        driver.rows[0].position = end
        if result.samples:  # type: ignore[union-attr]
            token = result.samples[0].token  # type: ignore[union-attr]
    return token


def test_prefill_chunks_read_features_at_their_positions(llava: Path) -> None:
    """Two images, chunks of 16 (the second image's positions split across chunks):
    greedy output equals the reference with the features in place."""
    engine = build_engine(llava)
    prompt, spans = _prompt_and_spans([1, 2])
    assert chunk_images(spans, prompt_start=16, prompt_len=16, packed_offset=0)[0].first > 0
    driver = ReferenceDriver(engine)
    out = [_prefill(driver, prompt, spans, chunk=16)]
    while len(out) < NEW_TOKENS:
        out += driver.decode(DECODE[1], [0])
    assert out == _expected(engine, prompt, spans)


def test_mixed_prompt_lane_reads_features_at_its_packed_offset(llava: Path) -> None:
    """A mixed frame whose prompt lane follows a decode lane (packed offset 1) reads
    the image features at that offset: its first token equals the reference's."""
    engine = build_engine(llava)
    prompt, spans = _prompt_and_spans([3])
    driver = ReferenceDriver(engine)
    driver.prefill(PREFILL_64, 1, prompt_of(8, 1, vocab=80), chunk=64)
    updates = (driver.init_row(0), *driver.pages_for(0, len(prompt)),
               *driver.pages_for(1, driver.rows[1].position + 1))
    driver.rows[0].position = len(prompt)
    driver.rows[1].position += 1
    from gpu.frames import MixedFrame

    result = driver.run(MIXED_2, MixedFrame(
        rows=(1, 0), prefill_row=1, prompt_tokens=tuple(prompt), prompt_ends=True,
        updates=updates, images=spans))
    first = result.samples[1].token  # type: ignore[union-attr]
    assert first == _expected(engine, prompt, spans)[0]


def test_feature_storage_is_keyed_by_pixels_and_bounded(llava: Path) -> None:
    """A repeated digest reads storage (no encode), a new one encodes; storage keeps at
    most ``stored_images`` (least recently used out first); a span of the wrong length
    is refused."""
    engine = build_engine(llava)
    assert engine.vision is not None
    program = VisionProgram(engine.vision, images=2, stored_images=2)
    a, b, c = (ImageSpan(digest=f"x{i}", image=_image(i), start=0, tokens=TOKENS_PER_IMAGE)
               for i in range(3))
    first = program.features_of([a, b])
    assert program.encoded_images == 2
    again = program.features_of([a])
    assert program.encoded_images == 2 and torch.equal(again[0], first[0])
    program.features_of([c])  # evicts b, the least recently used
    assert program.encoded_images == 3
    program.features_of([a])
    assert program.encoded_images == 3
    program.features_of([b])
    assert program.encoded_images == 4
    expected = engine.vision.encode(engine.vision.pixels([a.image, b.image]))
    assert torch.allclose(first[0], expected[0], atol=1e-5)
    assert not torch.allclose(first[0], first[1], atol=1e-3)
    with pytest.raises(FrameError, match="tokens"):
        program.features_of([ImageSpan(digest="y", image=_image(5), start=0, tokens=3)])


def _windowed_prefill(driver: ReferenceDriver, prompt: list[int], spans: tuple[ImageSpan, ...],
                      *, restore: bool) -> tuple[int, list[dict[str, int]]]:
    """Prefill one window (one image) per chunk, each chunk stopping before the next
    image; a chunk that starts a later window first snapshots row 0 into the private
    row 1 and restores it (``restore``), as the runtime's window snapshots do. Returns
    the first output token and row 0's feature placement after each chunk but the last."""
    ends = [s.start for s in spans[1:]] + [len(prompt)]
    program = driver.engine.parts.vision
    assert program is not None
    placements = []
    updates: tuple[StateUpdate, ...] = (driver.init_row(0),)
    start = token = 0
    for i, end in enumerate(ends):
        copies: tuple[RowCopy, ...] = ()
        if i and restore:
            ps = driver.page_size
            partial = start % ps != 0
            snapshot_page = driver.free_pages.pop(0) if partial else -1
            own = driver.rows[0].pages[start // ps] if partial else -1
            copies = (RowCopy(src_row=0, dst_row=1, dst_page=snapshot_page),
                      RowCopy(src_row=1, dst_row=0, dst_page=own))
        updates += driver.pages_for(0, end)
        result = driver.run(PREFILL_64, PrefillFrame(
            row=0, tokens=tuple(prompt[start:end]), start_position=start,
            ends_prompt=end == len(prompt), updates=updates, images=(spans[i],),
            copies=copies))
        updates = ()
        driver.rows[0].position = start = end
        if end < len(prompt):
            placements.append(program.placement(0))
        elif isinstance(result, StepResult):
            token = result.samples[0].token
    return token, placements


def test_window_restore_places_the_next_window_from_offset_zero(llava: Path) -> None:
    """Covers PRE-33, PRE-37, PRE-34: three images, one per window. Each later window's
    first chunk snapshots the row into a private row (partial page copied) and restores
    it: the restore begins a fresh row generation, whose placement puts the window's
    image at offset 0, and the restored state continues exactly (greedy tokens equal the
    reference). Without the restore the next window's image lies outside the row
    generation's window and the frame is refused."""
    engine = build_engine(llava)
    prompt, spans = _prompt_and_spans([1, 2, 3])
    driver = ReferenceDriver(engine)
    driver.rows[1] = RowMirror()
    assert any(s.start % driver.page_size for s in spans[1:])  # a partial page is copied
    token, placements = _windowed_prefill(driver, prompt, spans, restore=True)
    assert placements == [{"d1": 0}, {"d2": 0}]
    out = [token]
    while len(out) < NEW_TOKENS:
        out += driver.decode(DECODE[1], [0])
    assert out == _expected(engine, prompt, spans)
    with pytest.raises(FrameError, match="outside its generation's window"):
        _windowed_prefill(ReferenceDriver(build_engine(llava)), prompt, spans, restore=False)


def test_a_vision_frame_fills_the_storage_prompt_frames_read(llava: Path) -> None:
    """Covers PRE-1, PRE-27 on the program side: a ``VisionFrame`` bound to a program of
    two images encodes its images into the storage every vision program of the load
    shares (``with_images``) and returns a setup result; the prompt side then reads
    them without encoding, a frame of stored images encodes nothing, and a frame of
    more images than the program holds is refused."""
    engine = build_engine(llava)
    assert engine.vision is not None
    single = VisionProgram(engine.vision, images=1, stored_images=4)
    pair = single.with_images(2)
    assert pair.shape.batch_capacity == 2 and pair.storage is single.storage
    a, b, c = (ImageSpan(digest=f"v{i}", image=_image(i), start=0, tokens=TOKENS_PER_IMAGE)
               for i in range(3))
    pair.bind(as_inputs(VisionFrame(images=(a, b))))
    pair.execute()
    assert pair.read_outputs()[RESULT_KEY] == StateOpResult(lanes=2)
    assert single.encoded_images == 2
    features = single.features_of([a, b])
    assert single.encoded_images == 2
    expected = engine.vision.encode(engine.vision.pixels([a.image, b.image]))
    assert torch.allclose(features[1], expected[1], atol=1e-5)
    pair.bind(as_inputs(VisionFrame(images=(b,))))
    pair.execute()
    pair.read_outputs()
    assert single.encoded_images == 2
    with pytest.raises(FrameError, match="at most 2"):
        pair.bind(as_inputs(VisionFrame(images=(a, b, c))))
