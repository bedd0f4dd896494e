"""Vision programs as scheduled prerequisites, and chunks that hold an image whole
(``policy.vision_prerequisites``), through the production ``Scheduler``.

The measured synthetic catalog (``synthetic_catalog``) plus vision programs of 1, 2
and 4 images at 2 ms + 1 ms per image. A 100-token prompt with one 20-token image at
10..30, one-image windows unless a test says otherwise.
"""

from __future__ import annotations

import pytest
from selection_setup import make_decoder
from synthetic_catalog import (
    MS,
    Driver,
    decode,
    duration_ns,
    measured_scheduler,
    mixed,
    prefill,
    records_for,
)

from policy import ExecutionTiming, Fence, GraphKind, GraphShape, LaneRole, Scheduler
from policy.decision import build_context
from policy.prerequisites import continuation_index, multistage_rate, sequence_rate
from policy.vision_prerequisites import best_image_choice
from policy.vision_windows import ImagePlan, head_image, images_due, vision_lane_images


def vision(i: int) -> GraphShape:
    return GraphShape(kind=GraphKind.VISION, batch_capacity=i, token_capacity=20 * i)


def durations(shape: GraphShape) -> int:
    if shape.kind is GraphKind.VISION:
        return round((2.0 + 1.0 * shape.batch_capacity) * MS)
    return duration_ns(shape)


def _image(spans: tuple[tuple[int, int], ...] = ((10, 30),), window: int = 1,
           atomic: int = 64) -> ImagePlan:
    return ImagePlan(spans=spans, window_images=window, atomic_capacity=atomic)


def _scheduler(shapes: tuple[GraphShape, ...], measured: bool = True) -> Scheduler:
    if measured:
        return measured_scheduler(shapes, durations=durations)
    s = Scheduler(None, shapes)
    for shape in shapes:
        if shape.kind is not GraphKind.VISION:
            s.estimates.observe(shape, durations(shape), 1)
    s.advance_to(1)
    return s


def _context(s: Scheduler):  # type: ignore[no-untyped-def]
    return build_context(records=s._records, catalog=s._catalog,
                         times=s._shape_times(), config=s.config, queue=s._queue,
                         now_ns=s.now_ns, ttl_ns=s.estimates.ttl_ns, refresh_funded=False)


def _complete(s: Scheduler, fence: int, plan, ns: int) -> None:  # type: ignore[no-untyped-def]
    s.advance_to(s.now_ns + ns)
    s.complete(Fence(fence), records_for(plan), ExecutionTiming(device_intervals_ns=(ns,),
                                                                 wall_ns=ns))


CATALOG = (prefill(64), prefill(128), vision(1), vision(2), vision(4))


def test_pre_2_pre_11_pre_17_a_vision_pair_is_scored_over_t_plus_f() -> None:
    """Covers PRE-1, PRE-2, PRE-11, PRE-17, PRE-27: a request whose active window is not
    encoded is served by a vision frame first; its score is the two-stage sequence
    rate over T + F of the best following prefill (the 128-token one, which ends the
    prompt), and the plan keeps the vision program's own duration."""
    s = _scheduler(CATALOG)
    h = s.admit(prompt_len=100, max_output_tokens=4, images=_image())
    plan = s.plan()
    assert plan is not None and plan.shape == vision(1)
    assert [(lane.handle, lane.role, lane.prompt_start) for lane in plan.lanes] == [
        (h, LaneRole.VISION, 0)]
    assert plan.lookahead_shape == prefill(128)
    assert plan.estimated_duration_ns == durations(vision(1))
    assert plan.requires_empty_window
    ctx = _context(s)
    p = ctx.prompts
    value = 100 * p.price[0] + p.finish[0]
    t, f = durations(vision(1)) / MS, durations(prefill(128)) / MS
    expected = sequence_rate(value=value, first_ms=t, following_ms=f, waiting=0.0)
    assert plan.scaled_score == pytest.approx(expected)
    short = sequence_rate(value=64 * p.price[0], first_ms=t,
                          following_ms=durations(prefill(64)) / MS, waiting=0.0)
    assert expected > short


def test_pre_18_pre_19_pre_20_only_the_vision_frame_runs_and_learns_its_own_cost() -> None:
    """Covers PRE-18, PRE-19, PRE-20: completing the vision frame updates only the
    vision program's estimate (with its own interval), earns no tokens, and the
    following prefill is planned by a new decision, not submitted with it."""
    s = _scheduler(CATALOG)
    h = s.admit(prompt_len=100, max_output_tokens=4, images=_image())
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    _complete(s, 1, plan, 7 * MS)
    # its own interval joins its samples: the median of 3 ms and 7 ms (DUR-8)
    assert s.estimates.estimate_ns(vision(1)) == 5 * MS
    assert s.estimates.estimate_ns(prefill(128)) == durations(prefill(128))
    assert s.request(h).prompt_cursor == 0 and s.request(h).images_encoded == 1
    assert s.in_flight() == ()
    following = s.plan()
    assert following is not None and following.shape == prefill(128)
    assert following.lanes[0].role is LaneRole.PROMPT


def test_pre_24_unknown_vision_programs_are_discovered() -> None:
    """Covers PRE-24, DUR-22: an unmeasured vision program ranks first by useful value
    (a discovery frame), like any unknown program."""
    s = _scheduler(CATALOG, measured=False)
    s.admit(prompt_len=100, max_output_tokens=4, images=_image())
    plan = s.plan()
    assert plan is not None and plan.shape.kind is GraphKind.VISION
    assert not plan.duration_known and plan.reason.value == "discovery"


def test_pre_15_spare_vision_slots_encode_more_requests() -> None:
    """Covers PRE-15, PRE-16: with only a two-image vision program, one frame encodes
    both requests' windows."""
    s = _scheduler((prefill(64), prefill(128), vision(2)))
    a = s.admit(prompt_len=100, max_output_tokens=4, images=_image(window=2))
    b = s.admit(prompt_len=100, max_output_tokens=4, images=_image(window=2))
    plan = s.plan()
    assert plan is not None and plan.shape == vision(2)
    assert sorted(lane.handle for lane in plan.lanes) == sorted([a, b])


def test_pre_26_vision_never_evicts_what_a_ready_chunk_reads() -> None:
    """Covers PRE-26, PRE-27: with storage for one image, once A's image is encoded B's
    vision waits until A's chunk has read it, although B's prompt is worth more (its
    request has had far less service): vision A, prefill A, vision B, prefill B,
    never vision A then vision B (which would evict A's features)."""
    s = _scheduler(CATALOG)
    a = s.admit(prompt_len=100, max_output_tokens=4, images=_image())
    s.request(a).images_encoded = 1  # A's vision frame has run
    b = s.admit(prompt_len=100, max_output_tokens=4, images=_image())
    s.request(b).history.token_rate = 1e-6
    trace = Driver(s, durations).run(3)
    steps = [(p.shape.kind, p.lanes[0].handle) for p in trace.plans]
    assert steps == [(GraphKind.PREFILL, a), (GraphKind.VISION, b), (GraphKind.PREFILL, b)]


def test_pre_21_pre_23_a_window_larger_than_the_program_is_a_multistage_chain() -> None:
    """Covers PRE-21, PRE-22, PRE-23, PRE-25: three due images and a two-image vision
    program: the row needs a further vision stage, so it is ranked by the continuation
    index with F = the remaining vision execution plus its chunk; the frame encodes
    two images, the next one the third, then the prompt runs."""
    spans = ((0, 20), (20, 40), (40, 60))
    s = _scheduler((prefill(64), prefill(128), vision(2)))
    h = s.admit(prompt_len=100, max_output_tokens=4, images=_image(spans, window=3))
    choice = best_image_choice(_context(s))
    assert choice is not None and choice.basis == "multistage"
    p = _context(s).prompts
    t = durations(vision(2)) / MS
    best = None
    for shape in (prefill(64), prefill(128)):
        tokens = min(shape.token_capacity, 100)
        value = tokens * p.price[0] + (p.finish[0] if tokens == 100 else 0.0)
        further = durations(vision(2)) / MS + durations(shape) / MS
        rate = multistage_rate([continuation_index(value, t, further)], t, 0.0)
        best = rate if best is None else max(best, rate)
    assert choice.rate == pytest.approx(best)
    driver = Driver(s, durations)
    shapes = [driver.step().shape for _ in range(3)]  # type: ignore[union-attr]
    assert shapes == [vision(2), vision(2), prefill(128)]
    assert s.request(h).images_encoded == 3


def test_pre_28_each_window_is_encoded_before_its_chunks() -> None:
    """Covers PRE-27, PRE-28: two one-image windows: vision for the first, the chunk up
    to the second image, vision for the second, then the rest."""
    s = _scheduler(CATALOG)
    h = s.admit(prompt_len=100, max_output_tokens=4,
                images=_image(((10, 30), (50, 70))))
    trace = Driver(s, durations).run(5)
    kinds = [(p.shape.kind.value, p.lanes[0].prompt_start, p.lanes[0].prompt_tokens)
             for p in trace.plans[:4]]
    assert kinds == [("vision", 0, 0), ("prefill", 0, 50), ("vision", 1, 0),
                     ("prefill", 50, 50)]
    assert s.request(h).images_encoded == 2


def test_without_vision_programs_prompt_frames_encode_their_window() -> None:
    """The fused path: a catalog without vision programs never holds a row for vision;
    the first plan is the prompt chunk (its frame encodes the window)."""
    s = _scheduler((prefill(64), prefill(128)))
    s.admit(prompt_len=100, max_output_tokens=4, images=_image())
    plan = s.plan()
    assert plan is not None and plan.shape == prefill(128)


def _first_chunk(image: ImagePlan | None) -> int:
    """The first chunk's tokens for a 700-token prompt beside eight old decoders, whose
    waiting cost makes short chunks win; capacities 64, 256 and 1024."""
    s = _scheduler((prefill(64), prefill(256), prefill(1024),
                    *(GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1,
                                 packed_capacity=b) for b in (1, 2, 4, 8))))
    for _ in range(8):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=50.0)
    s.admit(prompt_len=700, max_output_tokens=4, images=image)
    for _ in range(20):
        plan = s.plan()
        assert plan is not None
        prompt = [lane for lane in plan.lanes if lane.role is LaneRole.PROMPT]
        if prompt:
            return prompt[0].prompt_tokens
        s.commit(plan, Fence(len(s.traces()) + 1))
        _complete(s, len(s.traces()), plan, durations(plan.shape))
    raise AssertionError("no prompt chunk planned")


def test_pre_29_a_capacity_holding_the_image_runs_its_chunk() -> None:
    """Covers PRE-29: a 576-token image at the cursor is never split while a prepared
    capacity (1024) holds it: the chunk consumes the whole image, although the same
    prompt without the image runs in a smaller chunk."""
    assert _first_chunk(None) < 576
    assert _first_chunk(_image(((0, 576),), atomic=64)) >= 576


def test_pre_5_pre_12_every_following_shape_is_scored_with_ready_decoders() -> None:
    """Covers PRE-2, PRE-5, PRE-9, PRE-12: beside a waiting decoder, the vision pair is
    the best over every following prefill and mixed shape, a mixed one also serving the
    ready decoder with its value aged to T + F (checked against every pair by hand)."""
    shapes = (prefill(64), prefill(128), mixed(2, 64), mixed(2, 128), decode(1), decode(2),
              vision(1))
    s = _scheduler(shapes)
    make_decoder(s, token_rate=0.001, delivery_rate=0.001, age_ms=200.0)
    s.admit(prompt_len=100, max_output_tokens=4, images=_image())
    ctx = _context(s)
    choice = best_image_choice(ctx)
    assert choice is not None and choice.basis == "pair"
    p, dec = ctx.prompts, ctx.decoders
    pos = p.held[0]
    t = durations(vision(1)) / MS
    rates = {}
    for shape in shapes[:4]:
        cap = shape.prefill_capacity or shape.token_capacity
        tokens = min(cap, 100)
        f = durations(shape) / MS
        value = tokens * p.price[pos] + (p.finish[pos] if tokens == 100 else 0.0)
        if shape.kind is GraphKind.MIXED:
            value += dec.base_list[0] + dec.slope * (t + f)
        rates[shape] = sequence_rate(value=value, first_ms=t, following_ms=f,
                                     waiting=ctx.waiting)
    best = max(rates, key=rates.__getitem__)
    assert best.kind is GraphKind.MIXED
    assert ctx.catalog.shapes[choice.following_shape] == best  # type: ignore[index]
    assert choice.rate == pytest.approx(rates[best])


def test_window_helpers() -> None:
    """``images_due``, ``head_image`` and ``vision_lane_images`` (PRE-27, PRE-29)."""
    plan = _image(((0, 20), (20, 40), (50, 70)), window=2, atomic=16)
    assert images_due(plan, 0, 0) == range(0, 2) and images_due(plan, 0, 1) == range(1, 2)
    assert images_due(plan, 0, 2) == range(0) and images_due(plan, 40, 2) == range(2, 3)
    assert head_image(plan, 0) == 20 and head_image(plan, 5) == 0
    assert head_image(_image(((0, 10),), atomic=16), 0) == 0  # a chunk holds it anyway
    assert vision_lane_images(plan, 0, 8) == range(0, 2)
    assert vision_lane_images(plan, 1, 8) == range(1, 2)
    assert vision_lane_images(plan, 0, 1) == range(0, 1)
    assert vision_lane_images(plan, 2, 8) == range(2, 3)
