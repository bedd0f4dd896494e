"""The two-slot window: what may queue, projection to the queue's end, overrun and
freshness rechecks (seed: *Planning and the execution queue*)."""

from __future__ import annotations

import pytest
from selection_setup import make_decoder, make_prompt
from synthetic_catalog import MS, decode, duration_ns, measured_scheduler, prefill, records_for

from policy import (
    ExecutionTiming,
    Fence,
    LaneRole,
    Scheduler,
    StalePlanError,
    WindowNotReady,
)
from policy.config import PolicyConfig


def timing(ns: int) -> ExecutionTiming:
    return ExecutionTiming(device_intervals_ns=(ns,), wall_ns=ns)


def two_decoders(shapes: tuple = (decode(1), decode(2)), **kw: object) -> Scheduler:
    s = measured_scheduler(shapes, **kw)  # type: ignore[arg-type]
    for i in range(2):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=float(i))
    return s


def test_queue_10_11_decode_occupies_both_slots_and_no_more() -> None:
    """Covers QUEUE-10, QUEUE-11, QUEUE-38."""
    s = two_decoders()
    first = s.plan()
    assert first is not None and first.shape.is_generation
    s.commit(first, Fence(1))
    second = s.plan()
    assert second is not None and s.window_ready(second)
    assert second.start_ns == first.start_ns + first.estimated_duration_ns  # QUEUE-38
    s.commit(second, Fence(2))
    third = s.plan()
    assert third is not None and not s.window_ready(third)
    with pytest.raises(WindowNotReady):
        s.commit(third, Fence(3))


def test_queue_12_32_34_35_prefill_winner_needs_empty_window() -> None:
    """Covers QUEUE-12, QUEUE-32, QUEUE-34, QUEUE-35: with a decode queued the prefill
    winner stays visible, cannot be submitted, and a ready decode does not replace it."""
    s = measured_scheduler((decode(2), prefill(512)))
    for _ in range(2):
        make_decoder(s, token_rate=50.0, delivery_rate=5.0, age_ms=0.0)
    decode_plan = s.plan()
    assert decode_plan is not None and decode_plan.shape == decode(2)
    s.commit(decode_plan, Fence(1))
    make_prompt(s, prompt_len=5000, token_rate=0.01)  # very underserved: high value
    winner = s.plan()
    assert winner is not None and winner.shape == prefill(512)
    assert winner.requires_empty_window and not s.window_ready(winner)
    with pytest.raises(WindowNotReady):
        s.commit(winner, Fence(2))
    assert s.in_flight() == (Fence(1),)
    s.advance_to(s.now_ns + duration_ns(decode(2)))
    s.complete(Fence(1), records_for(decode_plan), timing(duration_ns(decode(2))))
    replanned = s.plan()
    assert replanned is not None and replanned.shape == prefill(512)
    s.commit(replanned, Fence(2))
    behind = s.plan()
    assert behind is not None and not s.window_ready(behind)  # nothing queues behind it


def test_queue_15_finishing_prefill_exposes_decoder_only_after_completion() -> None:
    """Covers QUEUE-15."""
    s = measured_scheduler((prefill(512), decode(1)))
    h = s.admit(prompt_len=300, max_output_tokens=5)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    assert s.plan() is None
    s.advance_to(s.now_ns + duration_ns(prefill(512)))
    s.complete(Fence(1), records_for(plan), timing(duration_ns(prefill(512))))
    after = s.plan()
    assert after is not None and after.lanes[0].role is LaneRole.DECODE
    assert after.handles() == (h,)


def test_queue_39_40_overrun_suspends_queueing_until_feedback() -> None:
    """Covers QUEUE-39, QUEUE-40, OPEN-31."""
    s = two_decoders()
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    s.advance_to(s.now_ns + first.estimated_duration_ns + 1)  # still running: overrun
    second = s.plan()
    assert second is not None and not s.window_ready(second)
    s.complete(Fence(1), records_for(first), timing(first.estimated_duration_ns + 1))
    again = s.plan()
    assert again is not None and again.shape == first.shape  # still eligible
    s.commit(again, Fence(2))
    queued = s.plan()
    assert queued is not None and s.window_ready(queued)


def test_queue_38_39_queued_frame_does_not_inherit_a_late_predecessor() -> None:
    """Covers QUEUE-38, QUEUE-39, OPEN-31: the frame queued behind a late one starts
    when that one completes, so it overruns only past its own expected duration."""
    s = two_decoders()
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    second = s.plan()
    assert second is not None and s.window_ready(second)
    s.commit(second, Fence(2))
    late = first.estimated_duration_ns // 2
    s.advance_to(s.now_ns + first.estimated_duration_ns + late)  # the head runs late
    s.complete(Fence(1), records_for(first), timing(first.estimated_duration_ns + late))
    assert s.window_open()
    # Past the second frame's chained end (first end + its duration), not past its own.
    s.advance_to(s.now_ns + second.estimated_duration_ns - late + 1)
    assert s.window_open()
    third = s.plan()
    assert third is not None and s.window_ready(third)
    # Past its own expected end: an overrun suspends queueing (QUEUE-39).
    s.advance_to(s.now_ns + late)
    assert not s.window_open()


def test_queue_37_no_millisecond_cap_on_queued_frames() -> None:
    """Covers QUEUE-37: a 10 s frame queues behind a 10 s frame."""
    slow = {decode(2): 10_000 * MS}
    s = two_decoders((decode(2),), durations=slow.__getitem__)
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    second = s.plan()
    assert second is not None and s.window_ready(second)


def test_queue_42_43_projection_copies_prices_and_ages() -> None:
    """Covers QUEUE-33, QUEUE-41, QUEUE-42, QUEUE-43, QUEUE-46."""
    s = two_decoders()
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    stored = {h: (s.request(h).history.copy(), s.request(h).output_committed)
              for h in first.handles()}
    second = s.plan()
    assert second is not None
    assert {h: (s.request(h).history.copy(), s.request(h).output_committed)
            for h in first.handles()} == stored
    end = first.start_ns + first.estimated_duration_ns
    for h in first.handles():
        assert s.request(h).output_age_ns(end) == 0  # ages from the expected delivery
        assert s.request(h).output_age_ns(end + 5) == 5
    assert second.start_ns == end


def test_dur_25_unknown_winner_waits_for_empty_window() -> None:
    """Covers DUR-25, QUEUE-36."""
    s = two_decoders()
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    s.set_catalog((decode(1), decode(2), decode(4)))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    unknown = s.plan()
    assert unknown is not None and not unknown.duration_known
    assert not s.window_ready(unknown)


def test_dur_27_28_plan_outliving_freshness_is_rejected_behind_queue() -> None:
    """Covers DUR-27, DUR-28, OPEN-12: planned fresh, committed after the estimate went
    stale while a frame is in flight -> typed error; alone, a stale plan commits."""
    cfg = PolicyConfig(estimate_ttl_ns=50 * MS)
    s = two_decoders(config=cfg)
    first = s.plan()
    assert first is not None
    s.commit(first, Fence(1))
    fresh = s.plan()
    assert fresh is not None and not fresh.stale and s.window_ready(fresh)
    s.advance_to(s.now_ns + 60 * MS)
    with pytest.raises(StalePlanError):
        s.commit(fresh, Fence(2))
    s.complete(Fence(1), records_for(first), ExecutionTiming(device_intervals_ns=(0,),
                                                             wall_ns=MS))
    stale = s.plan()
    assert stale is not None and stale.stale and stale.requires_empty_window
    s.commit(stale, Fence(2))
    assert not s.window_ready(stale)


def test_queue_13_14_feedback_dependence_comes_from_the_selected_program() -> None:
    """Covers QUEUE-13, QUEUE-14: the empty-window flag follows the chosen shape and its
    estimate (fresh decode: queueable; stale, unknown, prefill, refresh: not)."""
    cfg = PolicyConfig(estimate_ttl_ns=50 * MS)
    s = two_decoders(config=cfg)
    fresh = s.plan()
    assert fresh is not None and not fresh.requires_empty_window
    s.advance_to(s.now_ns + 60 * MS)
    stale = s.plan()
    assert stale is not None and stale.stale and stale.requires_empty_window
    s.set_catalog((decode(1), decode(2), decode(4)))
    make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    unknown = s.plan()
    assert unknown is not None and not unknown.duration_known and unknown.requires_empty_window
    p = measured_scheduler((prefill(64),))
    make_prompt(p, prompt_len=50, token_rate=1.0)
    prompt_plan = p.plan()
    assert prompt_plan is not None and prompt_plan.requires_empty_window


def test_settled_is_the_window_end_or_else_the_latest_completion() -> None:
    """Covers U-13's wait: the device's work is settled to the queued frames' expected
    end, or with none queued to the latest completion, not to the planning instant."""
    s = two_decoders()
    queue = s._queue
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    assert queue.settled_ns(s.now_ns) == plan.start_ns + plan.estimated_duration_ns
    s.advance_to(s.now_ns + 3 * MS)
    s.complete(Fence(1), records_for(plan), timing(3 * MS))
    done = s.now_ns
    s.advance_to(done + 2 * MS)
    assert queue.settled_ns(s.now_ns) == done
