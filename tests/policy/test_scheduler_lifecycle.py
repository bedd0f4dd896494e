"""Scheduler lifecycle: admission, plan purity, commit checks, completion, publication.

Transitions are asserted by state, not by plan order (VER-21).
"""

from __future__ import annotations

import inspect
import math

import pytest
from synthetic_catalog import (
    MS,
    Driver,
    decode,
    duration_ns,
    measured_scheduler,
    ordinary_catalog,
    prefill,
    records_for,
)

from policy import (
    CommitRejected,
    CompletionError,
    CompletionRecord,
    ExecutionTiming,
    Fence,
    FinishKind,
    LaneRole,
    Phase,
    PolicyError,
    RequestHandle,
    Scheduler,
    SelectionReason,
    StaleEpochError,
    StalePlanError,
)
from policy.config import PolicyConfig


def timing(ns: int, wall: int | None = None) -> ExecutionTiming:
    return ExecutionTiming(device_intervals_ns=(ns,), wall_ns=ns if wall is None else wall)


def decoding_scheduler(n: int) -> tuple[Scheduler, list[RequestHandle]]:
    """n requests whose 64-token prompts are already consumed (now decoding)."""
    s = measured_scheduler(ordinary_catalog())
    handles = [s.admit(prompt_len=64, max_output_tokens=100) for _ in range(n)]
    d = Driver(s)
    while any(s.phase(h) is Phase.PREFILL for h in handles):
        d.step()
    return s, handles


def test_queue_1_api_signatures() -> None:
    """Covers QUEUE-1: the five methods with their parameters (``complete`` also takes
    a speculative frame's round report by keyword)."""
    params = {name: list(inspect.signature(getattr(Scheduler, name)).parameters)
              for name in ("advance_to", "plan", "commit", "complete", "published_output")}
    assert params == {
        "advance_to": ["self", "now_ns"], "plan": ["self"], "commit": ["self", "plan", "fence"],
        "complete": ["self", "fence", "records", "timing", "round"],
        "published_output": ["self", "handle", "fence", "host_time_ns"],
    }


def test_queue_2_plan_is_pure() -> None:
    """Covers QUEUE-2, SEL-11, QUEUE-44: plan() changes nothing."""
    s, handles = decoding_scheduler(3)
    before = [(s.request(h).history.copy(), s.request(h).output_committed,
               s.request(h).last_served_ns) for h in handles]
    first, second = s.plan(), s.plan()
    assert first == second
    after = [(s.request(h).history.copy(), s.request(h).output_committed,
              s.request(h).last_served_ns) for h in handles]
    assert before == after


def test_queue_8_cancel_stops_selection_at_once() -> None:
    """Covers QUEUE-8."""
    s, handles = decoding_scheduler(2)
    s.cancel(handles[0])
    plan = s.plan()
    assert plan is not None and handles[0] not in plan.handles()


def test_queue_6_commit_rejects_cancelled_epoch() -> None:
    """Covers QUEUE-6: a plan naming a cancelled request cannot commit."""
    s, handles = decoding_scheduler(2)
    plan = s.plan()
    assert plan is not None and handles[0] in plan.handles()
    s.cancel(handles[0])
    with pytest.raises(StaleEpochError):
        s.commit(plan, Fence(100))
    assert s.in_flight() == ()


def test_queue_7_commit_does_not_reselect() -> None:
    """Covers QUEUE-7, ACCT-12: a plan that is no longer the best still commits."""
    s, _ = decoding_scheduler(2)
    plan = s.plan()
    assert plan is not None
    s.advance_to(s.now_ns + 50 * MS)  # ages change; the plan need not be best any more
    s.admit(prompt_len=4000, max_output_tokens=4)
    trace = s.commit(plan, Fence(100))
    assert trace.shape == plan.shape and s.in_flight() == (Fence(100),)


def test_prompt_cursor_mismatch_is_stale_plan() -> None:
    """Covers QUEUE-6: commit rechecks committed cursors."""
    s = measured_scheduler(ordinary_catalog())
    s.admit(prompt_len=3000, max_output_tokens=4)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    s.advance_to(s.now_ns + duration_ns(plan.shape))
    s.complete(Fence(1), records_for(plan), timing(duration_ns(plan.shape)))
    with pytest.raises(StalePlanError):
        s.commit(plan, Fence(2))


def test_fences_must_increase_and_complete_in_order() -> None:
    s, _ = decoding_scheduler(1)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(10))
    with pytest.raises(CommitRejected):
        s.commit(plan, Fence(10))
    with pytest.raises(CompletionError):
        s.complete(Fence(11), [], timing(MS))


def test_sel_1_cached_prefix_earns_no_prompt_work() -> None:
    """Covers SEL-1, SEL-3: restored prompt history is never scheduled as prompt work."""
    s = measured_scheduler(ordinary_catalog())
    h = s.admit(prompt_len=1000, cached_prefix_len=900, max_output_tokens=4)
    plan = s.plan()
    assert plan is not None
    (lane,) = plan.lanes
    assert lane.prompt_start == 900 and lane.prompt_tokens == 100 and lane.handle == h


def test_acct_6_malformed_lane_fails_only_its_request() -> None:
    """Covers ACCT-6, VER-14: other lanes commit; nothing of the bad lane is applied."""
    s, handles = decoding_scheduler(2)
    plan = s.plan()
    assert plan is not None and set(plan.handles()) == set(handles)
    s.commit(plan, Fence(100))
    before = {h: s.request(h).output_committed for h in handles}
    bad, good = plan.lanes[0].handle, plan.lanes[1].handle
    recs = [CompletionRecord(handle=bad, epoch=plan.lanes[0].epoch, token_ids=(1, 2, 3)),
            CompletionRecord(handle=good, epoch=plan.lanes[1].epoch, token_ids=(5,))]
    out = s.complete(Fence(100), recs, timing(duration_ns(plan.shape)))
    by = {g.handle: g for g in out}
    assert by[bad].finish is FinishKind.ERROR and by[bad].token_ids == ()
    assert by[good].token_ids == (5,)
    assert s.request(good).output_committed == before[good] + 1
    assert s.request(bad).output_committed == before[bad]
    assert s.phase(bad) is Phase.RETIRED and s.statistics().failed_lanes == 1


def test_acct_13_14_15_one_delivery_per_visible_burst() -> None:
    """Covers ACCT-13, ACCT-14, ACCT-15, ACCT-19."""
    s = measured_scheduler(ordinary_catalog())
    h = s.admit(prompt_len=64, max_output_tokens=10)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(1))
    d = duration_ns(plan.shape)
    s.advance_to(s.now_ns + d)
    s.complete(Fence(1), records_for(plan), timing(d))
    assert s.request(h).history.delivery_rate is None  # zero deliveries recorded
    s.published_output(h, Fence(1), s.now_ns)
    z = s.request(h).history.delivery_rate
    assert z == pytest.approx(1 / (d / MS))  # first burst: one delivery over its frame
    s.published_output(h, Fence(1), s.now_ns + 1)
    assert s.request(h).history.delivery_rate == z


def test_acct_18_output_age_from_publication_time() -> None:
    """Covers ACCT-18, QUEUE-45: age resets only at publication."""
    s, (h,) = decoding_scheduler(1)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(100))
    s.advance_to(s.now_ns + 5 * MS)
    last_visible = s.request(h).last_visible_ns
    s.complete(Fence(100), records_for(plan), timing(5 * MS))
    assert s.request(h).last_visible_ns == last_visible
    s.nothing_published(h, Fence(100))
    s.advance_to(s.now_ns + 3 * MS)
    s.published_output(h, Fence(101), s.now_ns)
    assert s.request(h).last_visible_ns == s.now_ns


def test_acct_3_11_participants_fixed_at_commit() -> None:
    """Covers ACCT-1, ACCT-3, ACCT-11: unselected participants get zero service; a
    request admitted after dispatch is untouched by that frame."""
    s = measured_scheduler((prefill(64), decode(1)))
    a = s.admit(prompt_len=64, max_output_tokens=5)
    b = s.admit(prompt_len=64, max_output_tokens=5)
    plan = s.plan()
    assert plan is not None
    served, waiting = plan.lanes[0].handle, (b if plan.lanes[0].handle == a else a)
    s.commit(plan, Fence(1))
    late = s.admit(prompt_len=64, max_output_tokens=5)
    rates = {h: s.request(h).history.token_rate for h in (served, waiting, late)}
    s.advance_to(s.now_ns + 10 * MS)
    s.complete(Fence(1), records_for(plan), timing(10 * MS))
    assert s.request(waiting).history.token_rate < rates[waiting]
    zero_service_decay = math.exp(-10 / s.config.adaptation_ms)
    assert s.request(waiting).history.token_rate == pytest.approx(
        rates[waiting] * zero_service_decay)
    assert s.request(served).history.token_rate > rates[served] * zero_service_decay
    assert s.request(late).history.token_rate == rates[late]


def test_acct_5_cancelled_handle_cannot_charge_reused_handle() -> None:
    """Covers ACCT-5: a reused handle gets a new epoch; the old fence changes nothing."""
    s, (h,) = decoding_scheduler(1)
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(100))
    s.cancel(h)
    assert s.take_released() == []  # still owned through its submitted fence (QUEUE-9)
    s.advance_to(s.now_ns + 5 * MS)
    out = s.complete(Fence(100), records_for(plan), timing(5 * MS))
    assert out == []
    assert s.take_released() == [h]
    again = s.admit(prompt_len=64, max_output_tokens=5, handle=h)
    assert again == h and s.request(h).epoch == plan.lanes[0].epoch + 1


def test_pre_41_terminal_snapshot_retires_request() -> None:
    """Covers PRE-38, PRE-41, PRE-42, PRE-51: termination starts the terminal clock;
    the snapshot earns no tokens and releases the request. (A fraction of 0.5 lets
    the prompt's prefill work pay for the capture, QUEUE-20.)"""
    s = measured_scheduler(ordinary_catalog(with_snapshot=True),
                           PolicyConfig(checkpoint_extra_work_fraction=0.5))
    h = s.admit(prompt_len=64, max_output_tokens=1)
    d = Driver(s)
    d.step()  # the prefill produces the only allowed token
    assert s.phase(h) is Phase.TERMINAL and s.request(h).terminal_since_ns == s.now_ns
    s.published_output(h, Fence(1), s.now_ns + 5)
    assert s.request(h).terminal_since_ns == s.now_ns  # publication does not reset it
    plan = s.plan()
    assert plan is not None and plan.lanes[0].role is LaneRole.TERMINAL
    s.commit(plan, Fence(2))
    s.advance_to(s.now_ns + duration_ns(plan.shape))
    assert s.complete(Fence(2), records_for(plan), timing(duration_ns(plan.shape))) == []
    assert s.take_released() == [h]


def test_traces_and_counters_by_kind() -> None:
    """Covers ACC-32 (trace fields), LRN-20 (counters by kind)."""
    s = Scheduler(catalog=ordinary_catalog())
    s.admit(prompt_len=64, max_output_tokens=3)
    d = Driver(s)
    d.run(10)
    stats = s.statistics()
    traces = s.traces()
    assert stats.executions["discovery"] >= 2  # prefill and decode[B=1] discovered
    assert sum(stats.executions.values()) == len(traces) == stats.committed_plans
    assert stats.execution_ns["discovery"] > 0
    first = traces[0]
    assert first.reason is SelectionReason.DISCOVERY and first.observation_age_ns is None
    assert first.selected_cost_ns == 0
    later = [t for t in traces if t.reason is SelectionReason.ORDINARY]
    assert later and all(t.observation_age_ns is not None for t in later)


def test_pre_43_preemption_retires_without_finishing() -> None:
    """Covers PRE-41, PRE-43: preemption starts terminal retirement at once, emits no
    finish, and the snapshot releases the request."""
    s = measured_scheduler(ordinary_catalog(with_snapshot=True))
    h = s.admit(prompt_len=64, max_output_tokens=50)
    d = Driver(s)
    d.step()
    assert s.phase(h) is Phase.DECODE
    s.preempt(h)
    assert s.phase(h) is Phase.TERMINAL and s.request(h).terminal_since_ns == s.now_ns
    assert s.request(h).preempted
    plan = d.step()
    assert plan is not None and plan.lanes[0].role is LaneRole.TERMINAL
    assert all(g.finish is None for _, g in d.trace.tokens)
    assert h not in s.handles()


def test_configure_policy_only_before_admission() -> None:
    """Covers POL-19 / OPEN-29: preferences are supplied before admission."""
    s = Scheduler()
    s.configure_policy(PolicyConfig(decode_age_price=0.5))
    assert s.config.decode_age_price == 0.5
    s.admit(prompt_len=10, max_output_tokens=1)
    with pytest.raises(PolicyError):
        s.configure_policy(PolicyConfig())
