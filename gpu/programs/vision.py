"""The prepared vision programs and the feature storage the prompt programs read.

Owns four rules:

- **A fixed shape.** ``VisionProgram`` encodes exactly ``batch_capacity`` images per
  execution (``GraphKind.VISION``; ``token_capacity`` = that many images' feature
  tokens): its static pixel input and feature output are allocated once; unused image
  slots hold zeros and their features are discarded (CLIP attends within one image,
  so padding never changes another image's features). A vision-language load has one
  per catalog vision shape (``with_images``), all sharing one storage; a
  ``VisionFrame`` bound to one encodes its images into storage as a frame of its own
  (the scheduler's vision prerequisite), and a prompt frame encodes, inside itself,
  whatever images of its window storage lacks.
- **Bounded feature storage, keyed by pixels.** Encoded features are kept by the
  image's pixel digest (``ImageSpan.digest``), at most ``stored_images`` images, the
  least recently used dropped first. A repeated image is read from storage, not
  re-encoded; a different image has a different digest and never matches.
- **Compact placement per row generation** (PRE-33). A prompt reads its features from
  its row generation's *placement*: the active window's distinct images at compact
  offsets ``0, T, 2T, ...`` (``T`` feature tokens per image), in window order, built
  when the generation's first frame with images binds (from the encoded store). A
  generation begins whenever a frame initialises the row (``RowInit``: a new request)
  or restores it (a ``RowCopy`` into it: a window snapshot's restore), and its
  placement ends with the prompt. A frame asking for an image outside its
  generation's window is refused: the next window needs a fresh generation, so its
  offsets start from zero again.
- **Feature rows at the prompt's packed offset.** ``feature_rows`` maps the image
  positions a prompt chunk covers to packed rows (the prompt lane's packed offset plus
  the position's offset in the chunk) and their feature vectors: what
  ``PackedBatch.image_features`` puts in place of the placeholder embeddings. A chunk
  may cover part of an image; it reads that part's features.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu.frames import (
    FRAME_KEY,
    RESULT_KEY,
    FrameError,
    ImageSpan,
    RowCopy,
    RowInit,
    StateOpResult,
    StateUpdate,
    VisionFrame,
)
from gpu.model.vision import VisionTower
from policy.descriptors import GraphKind, GraphShape

DEFAULT_STORED_IMAGES = 8
"""Images whose features feature storage keeps (``--vision-feature-images``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkImage:
    """The part of one image a prompt chunk covers: feature tokens ``first..last-1``
    of the image land at packed rows ``row..``."""

    span: ImageSpan
    first: int
    last: int
    row: int


def chunk_images(spans: Sequence[ImageSpan], *, prompt_start: int, prompt_len: int,
                 packed_offset: int) -> tuple[ChunkImage, ...]:
    """The images a chunk at prompt positions ``prompt_start..+prompt_len`` covers,
    located in the packed layout (its prompt lane starts at ``packed_offset``)."""
    end = prompt_start + prompt_len
    parts = []
    for span in spans:
        lo, hi = max(span.start, prompt_start), min(span.start + span.tokens, end)
        if lo < hi:
            parts.append(ChunkImage(span=span, first=lo - span.start, last=hi - span.start,
                                    row=packed_offset + lo - prompt_start))
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class _Placement:
    offsets: dict[str, int]
    """Each window image's first feature row in ``values``: 0, T, 2T, ..."""
    values: torch.Tensor
    """``[images * T, hidden]``: the window's features, compact from row zero."""


class FeatureStorage:
    """Encoded features by pixel digest, at most ``capacity`` images, least recently
    used out first; shared by every vision program of a load."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("feature storage holds at least one image")
        self.capacity = capacity
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.placements: dict[int, _Placement] = {}
        """Each row's current generation's window features (compact offsets)."""
        self.encoded_images = 0
        """Images run through a tower so far (storage hits do not count)."""

    def keep(self, digests: Sequence[str], fresh: Mapping[str, torch.Tensor]) -> None:
        """Store ``fresh`` features and mark ``digests`` most recently used, then evict."""
        for d in digests:
            if d in fresh:
                self.entries[d] = fresh[d]
            if d in self.entries:
                self.entries.move_to_end(d)

    def evict(self) -> None:
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


class VisionProgram:
    """The vision tower as a prepared program of ``images`` images per execution,
    plus the feature storage it fills (``storage``: shared with the load's other
    vision programs; a fresh one of ``stored_images`` when None)."""

    def __init__(self, tower: VisionTower, *, images: int = 1,
                 stored_images: int = DEFAULT_STORED_IMAGES,
                 storage: FeatureStorage | None = None) -> None:
        if images < 1:
            raise ValueError("a vision program encodes at least one image")
        cfg = tower.config
        self.tower = tower
        self._shape = GraphShape(kind=GraphKind.VISION, batch_capacity=images,
                                 token_capacity=images * cfg.tokens_per_image)
        weight = tower.w["embeddings.patch_embedding.weight"]
        self._pixels = torch.zeros(images, cfg.num_channels, cfg.image_size, cfg.image_size,
                                   device=weight.device, dtype=weight.dtype)
        self._features = torch.zeros(images, cfg.tokens_per_image, cfg.text_hidden_size,
                                     device=weight.device, dtype=weight.dtype)
        self._bound: tuple[str, ...] = ()
        self._frame: VisionFrame | None = None
        self.storage = storage if storage is not None else FeatureStorage(stored_images)
        self.stored_images = self.storage.capacity
        self._store = self.storage.entries
        self._placements = self.storage.placements

    @property
    def encoded_images(self) -> int:
        """Images run through the tower so far by the load's vision programs."""
        return self.storage.encoded_images

    def with_images(self, images: int) -> VisionProgram:
        """The program of ``images`` images per execution on the same tower and storage."""
        return VisionProgram(self.tower, images=images, storage=self.storage)

    @property
    def shape(self) -> GraphShape:
        return self._shape

    @property
    def tokens_per_image(self) -> int:
        return self.tower.config.tokens_per_image

    # ------------------------------------------------------------ the program

    def bind(self, inputs: Mapping[str, Any]) -> None:
        """A ``VisionFrame`` (``inputs[FRAME_KEY]``): encode those of its images storage
        lacks; or ``inputs["images"]``: at most ``batch_capacity`` spans to encode."""
        frame = inputs.get(FRAME_KEY)
        self._frame = None
        if frame is not None:
            if not isinstance(frame, VisionFrame):
                raise FrameError(f"{self._shape.label()} takes a VisionFrame")
            self._check(frame.images)
            if len(frame.images) > self._shape.batch_capacity:
                raise FrameError(f"{self._shape.label()} encodes at most "
                                 f"{self._shape.batch_capacity} images, got {len(frame.images)}")
            spans = list({s.digest: s for s in frame.images
                          if s.digest not in self._store}.values())
            self._frame = frame
        else:
            spans = list(inputs["images"])
            if not 0 < len(spans) <= self._shape.batch_capacity:
                raise FrameError(f"{self._shape.label()} encodes "
                                 f"1..{self._shape.batch_capacity} images, got {len(spans)}")
        self._pixels.zero_()
        if spans:
            self._pixels[:len(spans)] = self.tower.pixels([s.image for s in spans])
        self._bound = tuple(s.digest for s in spans)

    def execute(self) -> None:
        self._features.copy_(self.tower.encode(self._pixels))

    def read_outputs(self) -> dict[str, Any]:
        fresh = {d: self._features[i].clone() for i, d in enumerate(self._bound)}
        if self._frame is None:
            return {RESULT_KEY: fresh}
        self.storage.encoded_images += len(fresh)
        self.storage.keep([s.digest for s in self._frame.images], fresh)
        self.storage.evict()
        return {RESULT_KEY: StateOpResult(lanes=len(self._frame.images))}

    def _check(self, spans: Sequence[ImageSpan]) -> None:
        for s in spans:
            if s.tokens != self.tokens_per_image:
                raise FrameError(f"an image span of {s.tokens} tokens; this tower writes "
                                 f"{self.tokens_per_image}")

    # ------------------------------------------------------------ storage

    def features_of(self, spans: Sequence[ImageSpan]) -> list[torch.Tensor]:
        """Each span's features ``[tokens_per_image, hidden]``: from storage, else
        encoded (the missing images in executions of ``batch_capacity``)."""
        missing = list({s.digest: s for s in spans if s.digest not in self._store}.values())
        if len(missing) > self.stored_images:
            raise FrameError(f"{len(missing)} images exceed the feature storage of "
                             f"{self.stored_images}")
        self._check(spans)
        capacity = self._shape.batch_capacity
        fresh: dict[str, torch.Tensor] = {}
        for i in range(0, len(missing), capacity):
            self.bind({"images": missing[i:i + capacity]})
            self.execute()
            fresh.update(self.read_outputs()[RESULT_KEY])
            self.storage.encoded_images += len(missing[i:i + capacity])
        self.storage.keep([s.digest for s in spans], fresh)
        out = [self._store[s.digest] for s in spans]
        self.storage.evict()
        return out

    def initialised(self, updates: Sequence[StateUpdate], copies: Sequence[RowCopy] = ()
                    ) -> None:
        """A frame's copies and updates were applied: each row they initialise, or a
        row copy writes (a restore), begins a fresh generation, whose placement starts
        again from offset zero."""
        for row in (*(u.row for u in updates if isinstance(u, RowInit)),
                    *(c.dst_row for c in copies)):
            self._placements.pop(row, None)

    def placement(self, row: int) -> dict[str, int]:
        """The feature offset of each image of ``row``'s current generation (empty
        before its first frame with images and after its prompt)."""
        placed = self._placements.get(row)
        return dict(placed.offsets) if placed is not None else {}

    def feature_rows(self, lane: tuple[int, bool], window: Sequence[ImageSpan],
                     parts: Sequence[ChunkImage]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The packed rows int64 ``[M]`` and features ``[M, hidden]`` of ``parts``
        (None when the chunk covers no image position), read from the placement of
        ``lane``'s row (``(row, the chunk ends the prompt)``); the generation's first
        frame with images populates storage with its ``window`` (the active window,
        PRE-27) and places it."""
        row, ends_prompt = lane
        placed = self._placements.get(row)
        digests = tuple(dict.fromkeys(s.digest for s in window))
        if placed is None:
            unique = list({s.digest: s for s in window}.values())
            t = self.tokens_per_image
            placed = _Placement(offsets={d: i * t for i, d in enumerate(digests)},
                                values=torch.cat(self.features_of(unique)))
            self._placements[row] = placed
        outside = [d for d in (*digests, *(p.span.digest for p in parts))
                   if d not in placed.offsets]
        if outside:
            raise FrameError(f"row {row}: {len(outside)} images outside its generation's "
                             "window (a new window starts a fresh generation)")
        if ends_prompt:
            del self._placements[row]
        if not parts:
            return None
        device = self._features.device
        rows = torch.cat([torch.arange(p.row, p.row + p.last - p.first, device=device)
                          for p in parts])
        values = torch.cat([placed.values[placed.offsets[p.span.digest] + p.first:
                                          placed.offsets[p.span.digest] + p.last]
                            for p in parts])
        return rows, values
