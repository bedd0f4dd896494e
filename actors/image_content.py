"""Image content in prompts: the scheduler's image plan, the images a prompt frame
carries, and the ids the prefix cache keys a prompt on.

Every position of an image holds the same placeholder id, so token ids alone would
let a different image match a cached one. The prefix cache therefore keys a prompt on
its *content ids*: the token ids, with each image position replaced by a negative id
drawn from the image's pixel digest and the position within the image. Equal pixels
give equal ids (a repeated image hits the cache), different pixels different ones
(never a match), and no content id equals a vocabulary id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu import ImageSpan
from policy import (
    DEFAULT_WINDOW_IMAGES,
    GraphShape,
    ImagePlan,
    smallest_prompt_capacity,
    window_spans,
)

__all__ = ["ImageWindowing", "content_ids", "frame_images", "image_plan"]

_DIGEST_HEX = 11
"""Hex digits of the digest a content id keeps (44 bits; ids stay within int64)."""
_INDEX_BITS = 16


def content_ids(prompt: Sequence[int], images: Sequence[ImageSpan]) -> tuple[int, ...]:
    """``prompt`` as the prefix cache keys it (the token ids when it has no image)."""
    if not images:
        return tuple(prompt)
    ids = list(prompt)
    for span in images:
        base = int(span.digest[:_DIGEST_HEX], 16) << _INDEX_BITS
        for j in range(span.tokens):
            ids[span.start + j] = -1 - (base + j)
    return tuple(ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageWindowing:
    """What the runtime plans every image prompt with."""

    window_images: int = DEFAULT_WINDOW_IMAGES
    """Images one window holds: the feature storage (``--vision-feature-images``)."""
    atomic_capacity: int = 1
    """The smallest prompt capacity of the served catalog."""

    @classmethod
    def of(cls, shapes: Sequence[GraphShape], window_images: int) -> ImageWindowing:
        return cls(window_images=window_images,
                   atomic_capacity=smallest_prompt_capacity(shapes))


def image_plan(images: Sequence[ImageSpan], windowing: ImageWindowing) -> ImagePlan | None:
    """The scheduler's view of a prompt's images (``policy.vision_windows``): their
    spans, windows and atomic capacity (None without images)."""
    if not images:
        return None
    return ImagePlan(spans=tuple((s.start, s.start + s.tokens) for s in images),
                     window_images=windowing.window_images,
                     atomic_capacity=windowing.atomic_capacity)


def frame_images(images: Sequence[ImageSpan], plan: ImagePlan | None,
                 cursor: int) -> tuple[ImageSpan, ...]:
    """The images a prompt frame from ``cursor`` carries: its active window's
    (PRE-27), which the vision program populates storage with."""
    if plan is None:
        return ()
    return tuple(images[i] for i in window_spans(plan, cursor))
