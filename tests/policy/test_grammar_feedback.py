"""The scheduler's grammar rules (``policy.grammar_feedback``; OPEN-22 as decided in
docs/design/requirements.md): a grammar-constrained request's plans require completion
feedback, and it never runs on speculative rows."""

from __future__ import annotations

from test_speculative_window import DECODE4, PREFILL64, decoders, measured, spec, submit

from policy.baselines.factory import make_policy
from policy.descriptors import ExecutionTiming, GraphKind
from policy.round_speculation import SpeculationSettings
from policy.rounds import SpeculationMode
from policy.scheduler import Scheduler
from policy.types import CompletionRecord, Fence, Phase, RequestHandle

MS = 1_000_000


def _constrain(s: Scheduler, means: tuple[float, ...], *, constrained: int, n: int = 4) -> None:
    for i, h in enumerate(decoders(s, means=means, n=n)):
        s.request(h).grammar_constrained = i < constrained


def test_queue_13_14_a_constrained_lane_makes_the_plan_wait_for_feedback() -> None:
    """Covers QUEUE-13, QUEUE-14: the same decode winner queues a second decode behind
    it when no lane is constrained, and requires an empty window (nothing queued behind
    it) when one of its lanes is."""
    free = measured()
    _constrain(free, (0.02, 0.01, 0.0), constrained=0)
    first = submit(free, 1)
    assert not first.requires_empty_window and free.window_open()

    s = measured()
    _constrain(s, (0.02, 0.01, 0.0), constrained=1)
    plan = submit(s, 1)
    assert plan.shape == DECODE4 and plan.requires_empty_window
    assert not s.window_open()
    again = s.plan()
    assert again is not None and not s.window_ready(again)


def test_sel_13_constrained_requests_do_not_speculate() -> None:
    """Covers SEL-13, QUEUE-13: with acceptance high enough that adaptive speculation
    picks a speculative round, a decision whose requests are constrained runs the
    ordinary decode of the same decision instead, waiting for feedback."""
    free = measured(SpeculationMode.ADAPTIVE)
    _constrain(free, (0.95, 0.9, 0.85), constrained=0)
    chosen = free.plan()
    assert chosen is not None and chosen.shape.kind is GraphKind.SPECULATIVE

    s = measured(SpeculationMode.ADAPTIVE)
    _constrain(s, (0.95, 0.9, 0.85), constrained=4)
    plan = s.plan()
    assert plan is not None and plan.shape.kind is GraphKind.DECODE
    assert plan.requires_empty_window


def test_queue_13_baselines_apply_the_feedback_rule() -> None:
    """Covers QUEUE-13: a baseline's decode over a request with a host grammar also
    requires completion feedback; without the constraint, or with a grammar resident
    where the frames run (flare's extension), it may queue."""
    for constrained, resident, expected in ((False, False, False), (True, False, True),
                                            (True, True, False)):
        policy = make_policy("fcfs", catalog=(DECODE4, PREFILL64))
        policy.advance_to(1_000 * MS)
        for shape in (DECODE4, PREFILL64):
            policy.estimates.observe(shape, 10 * MS, policy.now_ns)
        h = policy.admit(prompt_len=8, max_output_tokens=50,
                         grammar_constrained=constrained, grammar_resident=resident)
        record = policy.request(h)
        record.phase = Phase.DECODE
        record.prompt_cursor = 8
        record.output_committed = 1
        plan = policy.plan()
        assert plan is not None and plan.shape.kind is GraphKind.DECODE
        assert plan.requires_empty_window is expected


def _resident(s: Scheduler, means: tuple[float, ...], *, n: int = 4) -> list[RequestHandle]:
    handles = list(decoders(s, means=means, n=n))
    for h in handles:
        s.request(h).grammar_constrained = True
        s.request(h).grammar_resident = True
    return handles


def test_queue_13_a_resident_grammar_keeps_both_frame_slots() -> None:
    """Covers QUEUE-13, QUEUE-14 (flare's extension for resident grammars): when every
    constrained lane's grammar is held where the frames run, the plan needs no
    completion feedback and a second decode may queue behind it; one lane with a host
    grammar among them brings the feedback rule back."""
    s = measured()
    _resident(s, (0.02, 0.01, 0.0))
    plan = submit(s, 1)
    assert plan.shape == DECODE4 and not plan.requires_empty_window
    assert s.window_open()

    mixed = measured()
    first, *_ = _resident(mixed, (0.02, 0.01, 0.0))
    mixed.request(first).grammar_resident = False
    assert submit(mixed, 1).requires_empty_window


def test_sel_13_resident_grammars_still_do_not_speculate() -> None:
    """Covers SEL-13: a resident grammar lifts only the feedback rule; the decision
    still runs its ordinary decode rather than a speculative round."""
    s = measured(SpeculationMode.ADAPTIVE)
    _resident(s, (0.95, 0.9, 0.85))
    plan = s.plan()
    assert plan is not None and plan.shape.kind is GraphKind.DECODE
    assert not plan.requires_empty_window



def _fixed_width() -> Scheduler:
    """A measured fixed-width catalog (MIX-7): one speculative width, and the plain
    decode program constrained requests decode on."""
    catalog = (DECODE4, PREFILL64, spec(4))
    s = Scheduler(catalog=catalog, speculation=SpeculationSettings(mode=SpeculationMode.FIXED))
    s.advance_to(1_000 * MS)
    for shape in catalog:
        s.estimates.observe(shape, (12 if shape.kind is GraphKind.SPECULATIVE else 10) * MS,
                            s.now_ns)
    return s


def test_mix_7_sel_13_fixed_width_offers_plain_decodes_only_to_constrained_rows() -> None:
    """Covers MIX-7 and SEL-13 (flare's reading of fixed-width mode): whatever the
    acceptance, every plain decode serves only constrained requests and every round
    only the others, frame after frame, until the constrained request's age wins it a
    decode (each kind is served); constrained requests alone decode plainly."""
    for means in ((0.0, 0.0, 0.0), (0.95, 0.9, 0.85)):
        s = _fixed_width()
        _constrain(s, means, constrained=1)
        kinds = set()
        for fence in range(1, 101):
            if len(kinds) == 2:
                break
            plan = submit(s, fence)
            constrained = {s.request(lane.handle).grammar_constrained for lane in plan.lanes}
            kinds.add(plan.shape.kind)
            assert constrained == {plan.shape.kind is GraphKind.DECODE}, (means, fence, plan)
            s.advance_to(s.now_ns + plan.estimated_duration_ns)
            s.complete(Fence(fence), [
                CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(5,))
                for lane in plan.lanes], ExecutionTiming(
                    device_intervals_ns=(plan.estimated_duration_ns,),
                    wall_ns=plan.estimated_duration_ns))
        assert kinds == {GraphKind.DECODE, GraphKind.SPECULATIVE}, means

    alone = _fixed_width()
    _constrain(alone, (0.95, 0.9, 0.85), constrained=4)
    plan = alone.plan()
    assert plan is not None and plan.shape == DECODE4 and len(plan.lanes) == 4
