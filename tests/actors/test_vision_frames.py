"""Vision prerequisites in the runtime: the ``VisionFrame`` a vision plan packs into
(``actors.frame_inputs``).

Two requests with 2-position images: A's window holds its images 0..2 (image 0 is
encoded), B's its image 0. A vision plan on a program of four images packs A's two
images then B's one, in lane order; on a program of one image, A's first only. A
vision lane initialises no row and reserves no KV, so the request's first prompt
frame still carries its ``RowInit``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.frame_inputs import LaneSource, PackingError, kv_extent, mark_submitted, pack_frame
from actors.messages import RequestHandle, StateRow
from actors.public import GenerationRequest
from gpu import GREEDY, ImageSpan, VisionFrame
from policy import (
    GraphKind,
    GraphShape,
    ImagePlan,
    Lane,
    LaneRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)


def _vision(i: int) -> GraphShape:
    return GraphShape(kind=GraphKind.VISION, batch_capacity=i, token_capacity=2 * i)


def _source(handle: int, starts: tuple[int, ...], window: int) -> LaneSource:
    images = tuple(ImageSpan(digest=f"d{handle}{k}", image=None, start=s, tokens=2)
                   for k, s in enumerate(starts))
    request = GenerationRequest(prompt_token_ids=tuple(range(20)), max_tokens=4,
                                images=images)
    plan = ImagePlan(spans=tuple((s, s + 2) for s in starts), window_images=window,
                     atomic_capacity=64)
    return LaneSource(handle=RequestHandle(handle), epoch=1, row=StateRow(handle),
                      request=request, cached_tokens=0, cached_pages=(), sampling=GREEDY,
                      eos_token_ids=(0,), image_plan=plan)


def _plan(shape: GraphShape, lanes: tuple[tuple[int, int], ...]) -> ScheduledPlan:
    return ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=tuple(
            Lane(handle=RequestHandle(h), epoch=1, role=LaneRole.VISION, prompt_start=first)
            for h, first in lanes)),
        estimated_duration_ns=0, scaled_score=1.0, scale_exponent=0, duration_known=False,
        stale=False, reason=SelectionReason.DISCOVERY, requires_empty_window=True,
        planned_at_ns=0, start_ns=0, useful_value=1.0)


def test_a_vision_plan_packs_each_lanes_window_images_in_order() -> None:
    sources = {RequestHandle(0): _source(0, (0, 4, 8), window=3),
               RequestHandle(1): _source(1, (3,), window=2)}
    a, b = sources[RequestHandle(0)].request.images, sources[RequestHandle(1)].request.images
    frame, contexts = pack_frame(_plan(_vision(4), ((0, 1), (1, 0))), sources, ())
    assert frame == VisionFrame(images=(a[1], a[2], b[0]))
    assert [c.samples for c in contexts] == [False, False]
    one, _ = pack_frame(_plan(_vision(1), ((0, 1),)), sources, ())
    assert one == VisionFrame(images=(a[1],))
    plan = _plan(_vision(4), ((0, 1),))
    assert kv_extent(plan.lanes[0], sources[RequestHandle(0)]) == 0
    mark_submitted(plan, sources)
    assert not sources[RequestHandle(0)].initialised


def test_a_vision_lane_without_images_is_a_packing_error() -> None:
    sources = {RequestHandle(0): replace(_source(0, (0,), window=1), image_plan=None)}
    with pytest.raises(PackingError, match="no images"):
        pack_frame(_plan(_vision(1), ((0, 0),)), sources, ())
