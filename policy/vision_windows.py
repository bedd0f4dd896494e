"""Image dependencies of a prompt and the prefill chunks planned around them (seed:
*Prerequisites and completion*, the image paragraph).

This module owns four rules, all over prompt positions:

- **Whole-image windows** (PRE-26): the prompt's images, in order, are grouped into
  windows of at most ``window_images`` whole images, the images prepared feature
  storage holds; a window never splits an image.
- **The active window** (PRE-27): the window of the first image not yet wholly
  consumed at the prompt cursor. Vision work populates it, and only it: the images a
  prompt frame asks the vision program for are the active window's.
- **Prefill stops before the next window** (PRE-28): a chunk never reaches the first
  position of the following window's first image, so no chunk needs features that
  storage does not hold.
- **Atomic image spans** (PRE-29): a chunk boundary never falls inside an image. A
  chunk stops before the first image that a chunk of ``atomic_capacity`` tokens (the
  smallest prompt capacity in the catalog) from the cursor could not hold whole;
  every prepared prompt capacity is at least that, so whichever program runs the
  chunk, it ends outside every image. An image longer than ``atomic_capacity`` that
  starts at the cursor cannot be atomic and is split by the capacity.

Where the catalog has vision programs, two more (``images_due``, ``head_image``):
the images a vision prerequisite must encode before the next chunk (the active
window's, from the first not yet encoded), and the image a chunk starting at the
cursor must hold whole (PRE-29: ``policy.vision_prerequisites`` gives such a row only
the capacities that hold it).

Pure: no clocks, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from policy.descriptors import GraphKind, GraphShape

DEFAULT_WINDOW_IMAGES = 8
"""Images one window (the feature storage) holds unless ``--vision-feature-images``
says otherwise; the engine's feature storage has the same default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ImagePlan:
    """A prompt's image dependencies as prefill is planned around them."""

    spans: tuple[tuple[int, int], ...]
    """``(first position, end position)`` of each image, in prompt order."""
    window_images: int
    """Images one window holds: the feature storage's capacity (PRE-26)."""
    atomic_capacity: int
    """The smallest prompt capacity a chunk may run with (PRE-29)."""

    def __post_init__(self) -> None:
        if self.window_images < 1 or self.atomic_capacity < 1:
            raise ValueError("a window holds at least one image and a chunk one token")
        ends = [0] + [p for span in self.spans for p in span]
        if any(b < a for a, b in itertools.pairwise(ends)) or \
                any(s >= e for s, e in self.spans):
            raise ValueError("image spans must be non-empty, ordered and disjoint")


def smallest_prompt_capacity(shapes: Sequence[GraphShape]) -> int:
    """The fewest prompt tokens any prepared prefill or mixed program holds."""
    caps = [s.prefill_capacity if s.kind is GraphKind.MIXED else s.token_capacity
            for s in shapes
            if s.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.MIXED)]
    return min(caps, default=1)


def image_windows(plan: ImagePlan) -> tuple[range, ...]:
    """PRE-26: each window's image indices (consecutive whole images)."""
    n, k = len(plan.spans), plan.window_images
    return tuple(range(i, min(i + k, n)) for i in range(0, n, k))


def active_window(plan: ImagePlan, cursor: int) -> range:
    """PRE-27: the images of the window holding the first image that ends after
    ``cursor`` (empty when every image is behind the cursor)."""
    for window in image_windows(plan):
        if plan.spans[window[-1]][1] > cursor:
            return window
    return range(0)


def window_stop(plan: ImagePlan, cursor: int) -> int | None:
    """PRE-28: the first position of the next window's first image (None when the
    active window is the last)."""
    window = active_window(plan, cursor)
    if not window or window.stop >= len(plan.spans):
        return None
    return plan.spans[window.stop][0]


def atomic_stop(plan: ImagePlan, cursor: int) -> int | None:
    """PRE-29: the start of the first image after ``cursor`` that a chunk of
    ``atomic_capacity`` tokens from ``cursor`` could not hold whole (None: none)."""
    for start, end in plan.spans:
        if start > cursor and end - cursor > plan.atomic_capacity:
            return start
    return None


def image_chunk_end(plan: ImagePlan, cursor: int, limit: int) -> int:
    """Where a prefill chunk from ``cursor`` must stop, at most ``limit`` (the
    prompt's other boundaries): before the next window (PRE-28) and before an image
    a chunk could split (PRE-29). Always beyond ``cursor`` when ``limit`` is."""
    stops = [s for s in (window_stop(plan, cursor), atomic_stop(plan, cursor))
             if s is not None and s > cursor]
    return min([limit, *stops])


def window_spans(plan: ImagePlan, cursor: int) -> tuple[int, ...]:
    """The image indices a prompt frame from ``cursor`` asks the vision program for:
    the active window's (PRE-27)."""
    return tuple(active_window(plan, cursor))


def images_due(plan: ImagePlan, cursor: int, encoded: int) -> range:
    """The active window's images from ``encoded`` on (images ``0..encoded-1`` are
    encoded, in prompt order): what a vision prerequisite must encode before a chunk
    from ``cursor`` may run (empty: none)."""
    window = active_window(plan, cursor)
    return range(max(window.start, encoded), window.stop) if window else range(0)


def head_image(plan: ImagePlan, cursor: int) -> int:
    """The length of the image starting at ``cursor`` when a chunk of
    ``atomic_capacity`` could not hold it whole (0: none), the tokens a chunk from
    ``cursor`` must consume to keep it atomic (PRE-29)."""
    for start, end in plan.spans:
        if start == cursor:
            return end - start if end - start > plan.atomic_capacity else 0
        if start > cursor:
            break
    return 0


def vision_lane_images(plan: ImagePlan, first: int, capacity: int) -> range:
    """The images a vision lane whose first image is ``first`` encodes in a program of
    ``capacity`` images: the rest of that image's window, at most ``capacity`` (a
    frame's later lanes are whole windows that fit beside the first,
    ``policy.vision_prerequisites``)."""
    k = plan.window_images
    stop = min((first // k + 1) * k, len(plan.spans))
    return range(first, min(stop, first + capacity))


def stored_ahead(plan: ImagePlan, cursor: int, encoded: int) -> int:
    """How many encoded images of the active window a chunk from ``cursor`` still
    reads (images ``0..encoded-1`` are encoded): what the request needs kept in
    feature storage."""
    window = active_window(plan, cursor)
    return sum(1 for i in window if i < encoded and plan.spans[i][1] > cursor)
