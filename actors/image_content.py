"""Image content in prompts: which of a chunk's image spans a frame carries, and the
ids the prefix cache keys a prompt on.

Every position of an image holds the same placeholder id, so token ids alone would
let a different image match a cached one. The prefix cache therefore keys a prompt on
its *content ids*: the token ids, with each image position replaced by a negative id
drawn from the image's pixel digest and the position within the image. Equal pixels
give equal ids (a repeated image hits the cache), different pixels different ones
(never a match), and no content id equals a vocabulary id.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu import ImageSpan

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


def chunk_spans(images: Sequence[ImageSpan], start: int, end: int) -> tuple[ImageSpan, ...]:
    """The images with a position in ``start..end-1`` (what a prompt chunk carries)."""
    return tuple(s for s in images if s.start < end and start < s.start + s.tokens)
