"""The checkpoint allowance inside ``Scheduler``: whether a normal completion enters
terminal retirement with a capture (``Phase.TERMINAL``) or retires at once is the
request's allowance decision (QUEUE-20..23), preemption is mandatory, and an unknown
snapshot cost disables the capture (QUEUE-22)."""

from __future__ import annotations

from synthetic_catalog import (
    Driver,
    decode,
    duration_ns,
    measured_scheduler,
    ordinary_catalog,
    snapshot,
)

from policy import LaneRole, Phase, RequestHandle, Scheduler
from policy.config import PolicyConfig
from policy.descriptors import GraphKind, GraphShape


def run_until_output_ends(s: Scheduler, handle: RequestHandle, driver: Driver) -> None:
    while s.phase(handle) in (Phase.PREFILL, Phase.DECODE):
        assert driver.step() is not None


def test_queue_20_a_short_answer_does_not_pay_for_a_capture() -> None:
    """64 prompt tokens (4.28 ms of prefill: 0.21 ms at 5 %) and one output: the 1.2 ms
    snapshot does not fit, so the request retires at once and no terminal lane is
    planned."""
    s = measured_scheduler(ordinary_catalog(with_snapshot=True))
    h = s.admit(prompt_len=64, max_output_tokens=1)
    d = Driver(s)
    d.step()
    assert h not in s.handles()  # retired and released by the driver
    assert all(lane.role is not LaneRole.TERMINAL for p in d.trace.plans for lane in p.lanes)


def test_queue_23_decode_time_pays_for_a_distinct_terminal_capture() -> None:
    """30 outputs: 29 decodes of 8.05 ms earn 5 % of 233 ms = 11.7 ms, enough for the
    1.2 ms snapshot, which is charged to the request's ledger."""
    s = measured_scheduler(ordinary_catalog(with_snapshot=True))
    h = s.admit(prompt_len=64, max_output_tokens=30)
    d = Driver(s)
    run_until_output_ends(s, h, d)
    assert s.phase(h) is Phase.TERMINAL
    allowance = s.checkpoint_allowance(h)
    assert allowance.decode_ns == 29 * duration_ns(decode(1))
    assert allowance.spent_ns == duration_ns(snapshot(1))
    plan = d.step()
    assert plan is not None and plan.lanes[0].role is LaneRole.TERMINAL
    assert h not in s.handles()


def test_queue_22_unknown_snapshot_cost_disables_the_capture() -> None:
    """Plenty of decode earnings, but the snapshot shape was never measured."""
    def unmeasured_state(shape: GraphShape) -> int:
        return 0 if shape.kind is GraphKind.STATE else duration_ns(shape)

    s = measured_scheduler(ordinary_catalog(with_snapshot=True), durations=unmeasured_state)
    h = s.admit(prompt_len=64, max_output_tokens=30)
    d = Driver(s)
    while h in s.handles():
        assert s.phase(h) is not Phase.TERMINAL
        assert d.step() is not None


def test_queue_24_each_request_pays_from_its_own_allowance() -> None:
    """A long and a short request finish side by side: only the long one's decode
    time pays for its capture; the short one's allowance is not topped up by it."""
    s = measured_scheduler(ordinary_catalog(with_snapshot=True))
    long = s.admit(prompt_len=64, max_output_tokens=30)
    short = s.admit(prompt_len=64, max_output_tokens=2)
    d = Driver(s)
    phases: dict[RequestHandle, Phase] = {}
    while long in s.handles() or short in s.handles():
        for h in (long, short):
            if h in s.handles() and s.phase(h) not in (Phase.PREFILL, Phase.DECODE):
                phases.setdefault(h, s.phase(h))
        d.step()
    assert phases.get(long) is Phase.TERMINAL
    assert phases.get(short) in (None, Phase.RETIRED)


def test_pre_43_preemption_captures_whatever_the_allowance() -> None:
    """Preemption is mandatory retirement: it enters the terminal phase even with a
    zero fraction."""
    s = measured_scheduler(ordinary_catalog(with_snapshot=True),
                           PolicyConfig(checkpoint_extra_work_fraction=0.0))
    h = s.admit(prompt_len=64, max_output_tokens=50)
    Driver(s).step()
    s.preempt(h)
    assert s.phase(h) is Phase.TERMINAL
    assert s.checkpoint_allowance(h).spent_ns == 0
