"""Image windows and the prefill chunks planned around them (``policy.vision_windows``).

The pure rules (PRE-26..29) on a prompt with four images, and the scheduler's plans
for a request admitted with its image plan: every chunk it plans stops before the
next window and ends outside every image.
"""

from __future__ import annotations

import pytest
from synthetic_catalog import measured_scheduler, mixed, prefill

from policy.vision_windows import (
    ImagePlan,
    active_window,
    atomic_stop,
    image_chunk_end,
    image_windows,
    smallest_prompt_capacity,
    window_spans,
    window_stop,
)

SPANS = ((10, 30), (35, 55), (60, 80), (90, 110))
"""Four images of 20 positions; text between them."""


def _plan(window_images: int = 2, atomic_capacity: int = 64) -> ImagePlan:
    return ImagePlan(spans=SPANS, window_images=window_images,
                     atomic_capacity=atomic_capacity)


def test_pre_26_windows_hold_whole_images_within_storage() -> None:
    """Covers PRE-26: consecutive whole images, at most the storage's count each."""
    assert image_windows(_plan(2)) == (range(0, 2), range(2, 4))
    assert image_windows(_plan(3)) == (range(0, 3), range(3, 4))
    assert image_windows(_plan(1)) == tuple(range(i, i + 1) for i in range(4))
    for k in (1, 2, 3, 4, 5):
        windows = image_windows(_plan(k))
        assert [i for w in windows for i in w] == [0, 1, 2, 3]
        assert all(len(w) <= k for w in windows)
    with pytest.raises(ValueError):
        ImagePlan(spans=((10, 30), (20, 40)), window_images=1, atomic_capacity=64)


def test_pre_27_the_active_window_is_the_first_unconsumed_one() -> None:
    """Covers PRE-27: vision work populates the window of the first image not wholly
    behind the cursor, and only it."""
    plan = _plan(2)
    assert window_spans(plan, 0) == (0, 1)
    assert window_spans(plan, 54) == (0, 1)  # image 1 not yet wholly consumed
    assert window_spans(plan, 55) == (2, 3)
    assert active_window(plan, 110) == range(0)
    assert window_spans(plan, 110) == ()


def test_pre_28_prefill_stops_before_the_next_window() -> None:
    """Covers PRE-28: a chunk never reaches the following window's first image."""
    plan = _plan(2, atomic_capacity=1000)
    assert window_stop(plan, 0) == 60 and image_chunk_end(plan, 0, 200) == 60
    assert image_chunk_end(plan, 40, 200) == 60
    assert window_stop(plan, 60) is None and image_chunk_end(plan, 60, 200) == 200
    one = _plan(1, atomic_capacity=1000)
    assert [image_chunk_end(one, c, 200) for c in (0, 35, 60, 90)] == [35, 60, 90, 200]
    assert image_chunk_end(plan, 0, 50) == 50  # other boundaries still apply


def test_pre_29_no_chunk_of_any_capacity_ends_inside_an_image() -> None:
    """Covers PRE-29: with a smallest capacity of 32, a chunk from any cursor stops
    before the first image it could not hold whole, so whatever capacity >= 32 runs
    it, its end is outside every image."""
    plan = _plan(4, atomic_capacity=32)
    assert atomic_stop(plan, 0) == 35  # image 0 fits 32 tokens from 0, image 1 does not
    assert atomic_stop(plan, 35) == 60 and atomic_stop(plan, 60) == 90
    for cursor in range(0, 110):
        if any(s < cursor < e for s, e in SPANS):
            continue  # a chunk starts outside images (the previous one ended outside)
        end = image_chunk_end(plan, cursor, 120)
        assert end > cursor
        for capacity in (32, 40, 64, 256):
            stop = min(end, cursor + capacity)
            assert not any(s < stop < e for s, e in SPANS), (cursor, capacity, stop)


def test_pre_29_an_image_at_the_cursor_longer_than_a_chunk_is_split() -> None:
    """Covers PRE-29 (its limit): an image that no capacity holds is split, never
    stalled: the chunk from its start still makes progress."""
    plan = ImagePlan(spans=((0, 100),), window_images=1, atomic_capacity=64)
    assert image_chunk_end(plan, 0, 120) == 120


def test_smallest_prompt_capacity_reads_prefill_and_mixed() -> None:
    assert smallest_prompt_capacity((prefill(256), mixed(2, 128), prefill(512))) == 128


def _chunk_ends(window_images: int) -> list[int]:
    """The ends of the chunks the scheduler plans for the image prompt, one chunk at a
    time from the start (the only prepared prompt capacity is 64)."""
    s = measured_scheduler((prefill(64),))
    h = s.admit(prompt_len=120, max_output_tokens=4,
                images=_plan(window_images, atomic_capacity=64))
    record, cursor, ends = s.request(h), 0, []
    while cursor < 120:
        record.prompt_cursor = cursor
        chosen = s.plan()
        assert chosen is not None
        (lane,) = chosen.lanes
        assert lane.prompt_start == cursor
        cursor += lane.prompt_tokens
        ends.append(cursor)
    return ends


def test_scheduler_plans_chunks_around_windows_and_spans() -> None:
    """Covers PRE-28, PRE-29, SEL-40 (its image part): the scheduler's chunks for an
    image prompt stop at each next window (one-image windows: at every image but the
    first) and, with one window, before the image a 64-token chunk would split (at
    60, not 64)."""
    assert _chunk_ends(1) == [35, 60, 90, 120]
    assert _chunk_ends(4) == [60, 120]
