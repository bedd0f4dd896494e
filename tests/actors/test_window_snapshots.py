"""Window snapshots without a device: the checkpoint-allocator's private snapshot row and
snapshot plans (``actors.resource_book``), admission's ask for that row
(``actors.admission``), and the packing of a window boundary's snapshot and restore
copies (``actors.frame_inputs``, ``actors.window_snapshots``), and the fresh epoch the
boundary frame runs in (``actors.window_epochs``, ``actors.publisher``).

Covers PRE-30, PRE-31, PRE-32, PRE-35, PRE-36 (PRE-33 and PRE-34 on the device:
``tests/gpu/test_vision_program.py``, ``tests/gpu/test_vision_http.py``).
"""

from __future__ import annotations

import pytest
import trio

from actors.admission import AdmissionLimits, AdmissionState
from actors.frame_inputs import (
    LaneSource,
    PackingError,
    lane_extent,
    mark_submitted,
    pack_frame,
    settled,
)
from actors.messages import (
    Admit,
    Drop,
    EpochRenewed,
    Fence,
    Grant,
    LaneExtent,
    PagePlan,
    PublisherInbox,
    PublishFrame,
    RequestHandle,
    SnapshotPlan,
    StateRow,
    Track,
)
from actors.public import Finished, GenerationRequest, StreamEvent, TokenDelta
from actors.publisher import PublisherState
from actors.resource_book import ResourceBook
from actors.window_epochs import renew_window_epochs
from gpu.frames import GREEDY, ImageSpan, MixedFrame, PrefillFrame, RowCopy
from policy import GeneratedToken, Scheduler, with_epoch
from policy.descriptors import GraphKind, GraphShape
from policy.types import (
    DecodeMode,
    Lane,
    LaneRole,
    MixedRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.vision_windows import ImagePlan

PAGE = 4
T = 3
"""Feature tokens per image."""
IMG = 90
PROMPT = (1, 2, *[IMG] * T, 5, *[IMG] * T, 6, *[IMG] * T, 7)
"""Three images, at positions 2, 6 and 10."""
SPANS = tuple(ImageSpan(digest=f"d{i}", image=None, start=s, tokens=T)
              for i, s in enumerate((2, 6, 10)))
PLAN = ImagePlan(spans=tuple((s.start, s.start + T) for s in SPANS), window_images=1,
                 atomic_capacity=64)
PREFILL = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)


def _book() -> ResourceBook:
    return ResourceBook(num_pages=16, state_rows=4, page_size=PAGE)


def test_pre_30_a_multi_window_request_holds_one_private_snapshot_row() -> None:
    """Covers PRE-30: a request acquired with window snapshots holds its own row and
    exactly one private snapshot row (another row than any request's) until release;
    a single-window request holds one row; with one row free a multi-window request
    waits."""
    book = _book()
    multi = book.acquire(PROMPT, 4, window_snapshots=True)
    single = book.acquire(PROMPT, 4)
    assert multi is not None and single is not None
    assert multi.snapshot_row is not None and single.snapshot_row is None
    assert multi.snapshot_row not in (multi.row, single.row)
    stats = book.statistics()
    assert (stats.rows_free, stats.snapshot_rows) == (1, 1)
    assert book.acquire(PROMPT, 4, window_snapshots=True) is None
    assert book.release(multi.handle)
    assert (book.statistics().rows_free, book.statistics().snapshot_rows) == (3, 0)


def test_pre_30_admission_asks_for_a_snapshot_row_when_images_span_windows() -> None:
    """Covers PRE-30: admission's ``Acquire`` asks for the private row exactly when the
    prompt's images exceed one window (``--vision-feature-images``)."""
    def acquire(window_images: int) -> bool:
        state = AdmissionState(AdmissionLimits(max_context=64, vocab_size=100, max_queue=4,
                                               window_images=window_images))
        send, _ = trio.open_memory_channel[Grant | None](1)
        events, _events = trio.open_memory_channel[object](1)
        decision, _decision = trio.open_memory_channel[object](1)
        request = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=4, images=SPANS)
        admit = Admit(request_id="r", request=request, events=events,  # type: ignore[arg-type]
                      decision=decision)  # type: ignore[arg-type]
        assert state.on_admit(admit) is None
        msg = state.acquire_for_head(send)
        assert msg is not None
        return msg.window_snapshots

    assert acquire(1) and acquire(2) and not acquire(3)


def _prefilled_to(book: ResourceBook, grant: Grant, end: int) -> None:
    book.reserve(Fence(1), (LaneExtent(handle=grant.handle, kv_tokens=end),))
    book.retire(Fence(1))


def test_pre_35_pre_36_a_window_snapshot_is_private_and_stays_on_the_device() -> None:
    """Covers PRE-35, PRE-36, PRE-37: a window snapshot at a consumed extent plans the
    request's row into its private row with the request's own device pages by reference
    and its partial page into one snapshot page (the same page at every boundary); the
    prefix cache is unchanged by it (no entry, no lookup hit), and at release the
    snapshot page returns to the pool without being published. Nothing is copied to a
    host tier: the plan names only device rows and pages."""
    book = _book()
    grant = book.acquire(PROMPT, 4, window_snapshots=True)
    assert grant is not None and grant.snapshot_row is not None
    _prefilled_to(book, grant, 6)
    cache_before = book.cache.statistics()
    plans = book.reserve(Fence(2), (LaneExtent(handle=grant.handle, kv_tokens=10,
                                                window_snapshot_at=6),))
    snap, pages = plans
    assert isinstance(snap, SnapshotPlan) and isinstance(pages, PagePlan)
    own = book.page_table(grant.handle)
    assert (snap.row, snap.scratch_row, snap.kv_tokens) == (grant.row, grant.snapshot_row, 6)
    assert snap.page_ids == own[:2] and snap.dst_page not in own and snap.dst_page >= 0
    book.retire(Fence(2))
    (again, _) = book.reserve(Fence(3), (LaneExtent(handle=grant.handle, kv_tokens=14,
                                                    window_snapshot_at=10),))
    assert isinstance(again, SnapshotPlan) and again.dst_page == snap.dst_page
    book.retire(Fence(3))
    assert book.cache.statistics() == cache_before
    hit = book.cache.lookup(PROMPT, limit_tokens=len(PROMPT) - 1)
    assert hit.tokens == 0
    book.cache.give_back(hit)
    assert book.release(grant.handle, token_ids=PROMPT, kv_tokens=13, publish=True)
    assert book.pages.free_count == book.pages.total - book.cache.statistics().pages
    assert book.cache.statistics().pages == 13 // PAGE + 1  # the request's own pages


def _source(*, initialised: bool, window: int | None, in_flight: int = 0) -> LaneSource:
    request = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=4, images=SPANS)
    return LaneSource(handle=RequestHandle(0), epoch=1, row=StateRow(0), request=request,
                      cached_tokens=0, cached_pages=(), sampling=GREEDY, eos_token_ids=(2,),
                      initialised=initialised, image_plan=PLAN, window=window,
                      in_flight=in_flight)


def _plan(start: int, tokens: int, *, shape: GraphShape = PREFILL,
          before: tuple[Lane, ...] = ()) -> ScheduledPlan:
    """A plan whose prompt lane (request 0) follows the lanes ``before`` (a mixed plan
    when there are any)."""
    lane = Lane(handle=RequestHandle(0), epoch=1, role=LaneRole.PROMPT, prompt_start=start,
                prompt_tokens=tokens, token_ceiling=0)
    mixed = MixedRole(prefill_row=len(before), decode_mode=DecodeMode.ORDINARY) \
        if before else None
    return ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=(*before, lane), mixed=mixed),
        estimated_duration_ns=1,
        scaled_score=1.0, scale_exponent=0, duration_known=True, stale=False,
        reason=SelectionReason.ORDINARY, requires_empty_window=False, planned_at_ns=0,
        start_ns=0, useful_value=1.0)


SNAP = SnapshotPlan(handle=RequestHandle(0), row=StateRow(0), scratch_row=StateRow(3),
                    kv_tokens=6, page_ids=(8, 9), dst_page=12)
PAGES = PagePlan(handle=RequestHandle(0), row=StateRow(0), first_block=2, page_ids=(10,))


def test_pre_31_a_later_window_is_snapshotted_and_restored_only_when_drained() -> None:
    """Covers PRE-31, PRE-33: the first chunk of a later window asks for a snapshot at its
    start and carries the snapshot copy into the private row, then the restore (the
    partial page back into the request's own page); it is refused while a frame of the
    request is in flight. The first chunk of a request (a fresh row) and a chunk within
    the window its row holds carry none."""
    plan = _plan(6, 4)
    drained = _source(initialised=True, window=0)
    assert lane_extent(plan.lanes[0], drained).window_snapshot_at == 6
    frame, _ = pack_frame(plan, {RequestHandle(0): drained}, [PAGES], [SNAP])
    assert isinstance(frame, PrefillFrame)
    assert frame.copies == (RowCopy(src_row=0, dst_row=3, dst_page=12),
                            RowCopy(src_row=3, dst_row=0, dst_page=9))
    assert mark_submitted(plan, {RequestHandle(0): drained}) == 1
    assert (drained.window, drained.in_flight) == (1, 1)
    assert settled(plan.lanes[0], drained, ok=True) and drained.in_flight == 0
    busy = _source(initialised=True, window=0, in_flight=1)
    with pytest.raises(PackingError, match="in flight"):
        pack_frame(plan, {RequestHandle(0): busy}, [PAGES], [SNAP])
    for quiet in (_source(initialised=False, window=None), _source(initialised=True, window=1)):
        assert lane_extent(plan.lanes[0], quiet).window_snapshot_at is None
        frame, _ = pack_frame(plan, {RequestHandle(0): quiet}, [PAGES])
        assert isinstance(frame, PrefillFrame) and frame.copies == ()


def test_pre_31_a_mixed_frame_carries_its_prompt_lanes_window_copies() -> None:
    """Covers PRE-31: a boundary chunk in a mixed frame (after a decode lane) carries the
    same snapshot and restore copies, for its prompt row only."""
    mixed = GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=1,
                       prefill_capacity=64, packed_capacity=65)
    decode = Lane(handle=RequestHandle(1), epoch=1, role=LaneRole.DECODE, token_ceiling=1)
    plan = _plan(6, 4, shape=mixed, before=(decode,))
    decoder = LaneSource(handle=RequestHandle(1), epoch=1, row=StateRow(1),
                         request=GenerationRequest(prompt_token_ids=(3, 4), max_tokens=4),
                         cached_tokens=0, cached_pages=(), sampling=GREEDY,
                         eos_token_ids=(2,), initialised=True, output_ids=[5], in_flight=1)
    sources = {RequestHandle(0): _source(initialised=True, window=0),
               RequestHandle(1): decoder}
    frame, _ = pack_frame(plan, sources, [PAGES], [SNAP])
    assert isinstance(frame, MixedFrame) and frame.prefill_row == 1
    assert frame.copies == (RowCopy(src_row=0, dst_row=3, dst_page=12),
                            RowCopy(src_row=3, dst_row=0, dst_page=9))


async def test_pre_32_a_boundary_frame_runs_in_a_fresh_epoch() -> None:
    """Covers PRE-32, PRE-34: before a boundary chunk is packed, the request's epoch is
    renewed in the policy, in its ``LaneSource`` and in the publisher's stream; the
    plan's lane and the packed frame's lane context carry the new epoch, and the
    planner's bookkeeping rejects a completion of the old epoch. A chunk within the
    window its row holds, or a request's first chunk, keeps its epoch."""
    policy = Scheduler(None, (PREFILL,))
    h = policy.admit(prompt_len=len(PROMPT), max_output_tokens=4, handle=RequestHandle(0),
                     images=PLAN)
    old = policy.request(h).epoch
    send, receive = trio.open_memory_channel[PublisherInbox](4)
    for quiet in (_source(initialised=False, window=None), _source(initialised=True, window=1)):
        quiet.epoch = old
        plan = with_epoch(_plan(6, 4), h, old)
        assert await renew_window_epochs(plan, {h: quiet}, policy, send) is plan
        assert policy.request(h).epoch == quiet.epoch == old
    with pytest.raises(trio.WouldBlock):
        receive.receive_nowait()
    source = _source(initialised=True, window=0)
    source.epoch = old
    plan = with_epoch(_plan(6, 4), h, old)
    rebound = await renew_window_epochs(plan, {h: source}, policy, send)
    assert policy.request(h).epoch == source.epoch == old + 1
    assert [lane.epoch for lane in rebound.lanes] == [old + 1]
    assert receive.receive_nowait() == EpochRenewed(handle=h, epoch=old + 1)
    _, contexts = pack_frame(rebound, {h: source}, [PAGES], [SNAP])
    assert [c.epoch for c in contexts] == [old + 1]
    assert mark_submitted(rebound, {h: source}) == 1
    assert not settled(plan.lanes[0], source, ok=True) and source.in_flight == 1
    assert settled(rebound.lanes[0], source, ok=True) and source.in_flight == 0


def test_pre_32_the_stream_follows_its_request_into_the_new_epoch() -> None:
    """Covers PRE-32, PRE-34: after ``EpochRenewed`` the publisher delivers the
    request's output of the new epoch on its one stream and ends it on a ``Drop`` of the
    new epoch; output and drops of the old epoch no longer reach it."""
    state = PublisherState(decode=lambda ids: "".join(f"<{i}>" for i in ids),
                           eos_token_ids=(2,), clock_ns=lambda: 0)
    events, received = trio.open_memory_channel[StreamEvent](8)
    h = RequestHandle(0)
    state.track(Track(request_id="r", handle=h, epoch=3, request=GenerationRequest(
        prompt_token_ids=PROMPT, max_tokens=4), cached_tokens=0, events=events))
    state.renew(EpochRenewed(handle=h, epoch=4))

    def frame(fence: int, epoch: int, token: int) -> PublishFrame:
        return PublishFrame(fence=Fence(fence), tokens=(GeneratedToken(
            handle=h, epoch=epoch, fence=Fence(fence), token_ids=(token,)),),
            logprobs=((),), errors=())

    assert state.publish(frame(1, 3, 11)).visible == ()
    assert state.publish(frame(2, 4, 12)).visible == ((h, 0),)
    state.drop(Drop(handle=h, epoch=3, reason="cancelled"))
    assert state.tracked == 1
    state.drop(Drop(handle=h, epoch=4, reason="stop"))
    assert state.tracked == 0
    delta, finished = received.receive_nowait(), received.receive_nowait()
    assert isinstance(delta, TokenDelta) and delta.token_ids == (12,)
    assert isinstance(finished, Finished) and finished.reason == "stop"
