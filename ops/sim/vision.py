"""Image prompts in ``flare sim``: where a simulated prompt's images sit and what the
vision program costs, as flare runs it (``docs/vision.md``).

With ``VisionLoad.images_per_request > 0`` every request's prompt holds that many
images of ``tokens_per_image`` positions, evenly spaced (the first at the start of its
share of the prompt; a prompt too short for them holds as many as fit). The request is
admitted with its ``policy.vision_windows.ImagePlan`` (windows of ``window_images``,
the catalog's smallest prompt capacity), so the policy's chunks stop at windows and
never split an image, exactly as in ``flare run``. Vision runs one of two ways:

- **fused** (``scheduled`` False, the only way without vision programs): a prompt frame encodes the images of its active
  window not yet encoded for its request, inside the frame, one image per execution
  as ``flare run``'s in-frame vision program does: each adds ``ms_per_execution +
  ms_per_image`` to the frame's duration;
- **scheduled** (the default, as ``flare run`` on the CPU backend): the catalog also holds ``gpu.catalog.vision_shapes`` (programs of
  1, 2, 4, ... images up to a window) and the policy runs them as prerequisites of
  the chunks (``policy.vision_prerequisites``); a vision frame of I images takes
  ``ms_per_execution + I * ms_per_image`` (unused slots cost as much as used ones)
  and marks its lanes' images encoded. A prompt frame still encodes whatever its window lacks (a policy
  without vision prerequisites, the baselines, runs fused).

``ms_per_image`` and ``ms_per_execution`` are synthetic figures: vision programs are
not in the measured cost tables.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpu.catalog import vision_shapes
from policy.descriptors import GraphKind, GraphShape
from policy.types import LaneRole, RequestHandle, ScheduledPlan
from policy.vision_windows import (
    DEFAULT_WINDOW_IMAGES,
    ImagePlan,
    smallest_prompt_capacity,
    vision_lane_images,
    window_spans,
)

NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionLoad:
    """The simulated image traffic and vision cost (off with no images)."""

    images_per_request: int = 0
    tokens_per_image: int = 576
    """LLaVA-1.5's 24x24 patches."""
    window_images: int = DEFAULT_WINDOW_IMAGES
    """Feature storage in images (``flare run --vision-feature-images``)."""
    ms_per_image: float = 4.0
    """Synthetic duration of encoding one image, added to the frame that does it."""
    ms_per_execution: float = 0.0
    """Synthetic fixed cost of one vision program execution (launch, preprocessing)."""
    scheduled: bool = True
    """Vision programs in the catalog, run as scheduled prerequisites (as ``flare run``
    on the CPU backend); False: fused into the prompt frames."""

    def __post_init__(self) -> None:
        if self.images_per_request < 0 or self.tokens_per_image < 1 or \
                self.window_images < 1 or not self.ms_per_image >= 0 or \
                not self.ms_per_execution >= 0:
            raise ValueError("vision load: images >= 0, tokens per image and window images "
                             ">= 1, a non-negative cost per image")

    def plan_for(self, prompt_tokens: int, shapes: Iterable[GraphShape]) -> ImagePlan | None:
        """The image plan of a prompt of ``prompt_tokens`` (None: no image fits)."""
        count = min(self.images_per_request, prompt_tokens // self.tokens_per_image)
        if count <= 0:
            return None
        share = prompt_tokens // count
        spans = tuple((k * share, k * share + self.tokens_per_image) for k in range(count))
        return ImagePlan(spans=spans, window_images=self.window_images,
                         atomic_capacity=smallest_prompt_capacity(tuple(shapes)))

    def catalog(self, shapes: Iterable[GraphShape]) -> tuple[GraphShape, ...]:
        """``shapes`` plus the vision programs when vision is scheduled."""
        shapes = tuple(shapes)
        if not self.scheduled or not self.images_per_request:
            return shapes
        return shapes + vision_shapes(window_images=self.window_images,
                                      tokens_per_image=self.tokens_per_image)

    def to_json(self) -> dict[str, Any]:
        return {"images_per_request": self.images_per_request,
                "tokens_per_image": self.tokens_per_image,
                "window_images": self.window_images, "ms_per_image": self.ms_per_image,
                "ms_per_execution": self.ms_per_execution, "scheduled": self.scheduled}


@dataclass(slots=True)
class VisionWork:
    """What the simulated vision programs did, and the feature storage they fill: at
    most ``window_images`` images, least recently used out first, as flare's
    storage (an image is one request's: simulated requests share no image)."""

    load: VisionLoad
    plans: dict[RequestHandle, ImagePlan] = field(default_factory=dict)
    stored: OrderedDict[tuple[RequestHandle, int], None] = field(default_factory=OrderedDict)
    images: int = 0
    """Images encoded (again, after an eviction)."""
    busy_ns: int = 0

    def frame_ns(self, plan: ScheduledPlan) -> int:
        """Vision time of ``plan``: a vision frame's whole duration (its lanes' images
        enter storage), else what its prompt lanes add: encoding the images of each
        lane's active window that storage lacks (PRE-27)."""
        load = self.load
        if plan.shape.kind is GraphKind.VISION:
            capacity = plan.shape.batch_capacity
            for lane in plan.lanes:
                images = vision_lane_images(self.plans[lane.handle], lane.prompt_start,
                                            capacity)
                self._keep(lane.handle, images)
                self.images += len(images)
                capacity -= len(images)
            ns = round((load.ms_per_execution + plan.shape.batch_capacity * load.ms_per_image)
                       * NS_PER_MS)
            self.busy_ns += ns
            return ns
        extra = 0
        for lane in plan.lanes:
            image_plan = self.plans.get(lane.handle)
            if lane.role is not LaneRole.PROMPT or image_plan is None:
                continue
            window = window_spans(image_plan, lane.prompt_start)
            fresh = [i for i in window if (lane.handle, i) not in self.stored]
            self._keep(lane.handle, window)
            extra += round(len(fresh) * (load.ms_per_execution + load.ms_per_image)
                           * NS_PER_MS)
            self.images += len(fresh)
        self.busy_ns += extra
        return extra

    def _keep(self, handle: RequestHandle, images: Iterable[int]) -> None:
        for i in images:
            self.stored[(handle, i)] = None
            self.stored.move_to_end((handle, i))
        while len(self.stored) > self.load.window_images:
            self.stored.popitem(last=False)

    def release(self, handle: RequestHandle) -> None:
        """A finished request's features leave storage (its handle may be reused)."""
        self.plans.pop(handle, None)
        for key in [k for k in self.stored if k[0] == handle]:
            del self.stored[key]

    def stats(self, frames: Mapping[str, int]) -> dict[str, Any]:
        return {"images_encoded": self.images, "busy_s": self.busy_ns / 1e9,
                "prefill_frames": frames.get("prefill", 0) + frames.get("mixed", 0),
                "vision_frames": frames.get("vision", 0)}
