"""Speculative decode rows in wider mixed programs (``policy/mixed_rounds.py``) through
the speculating ``Scheduler`` (seed: *Mixed execution contract*)."""

from __future__ import annotations

from test_speculative_scheduler import funded_refresh, stale_except
from test_speculative_window import DECODE4, MS, PREFILL64, spec

from policy.descriptors import ExecutionTiming, GraphKind, GraphShape
from policy.mixed_rounds import wider_mixed_shapes
from policy.protocol import RoundCompletion, RoundLaneOutcome
from policy.round_speculation import SpeculationSettings
from policy.scheduler import Scheduler
from policy.speculation import INITIAL_WEIGHT, ProposalSource
from policy.types import (
    CompletionRecord,
    DecodeMode,
    Fence,
    LaneRole,
    MixedRole,
    Phase,
    RequestHandle,
    SelectionReason,
)


def mixed(w: int, b: int = 4, c: int = 64) -> GraphShape:
    return GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, prefill_capacity=c,
                      packed_capacity=c + (b - 1) * w, speculation_enabled=True)


CATALOG = [DECODE4, PREFILL64, spec(1), spec(3), mixed(1), mixed(3)]


def scheduler(costs_ms: dict[GraphShape, int]) -> Scheduler:
    s = Scheduler(catalog=CATALOG, speculation=SpeculationSettings(source=ProposalSource.LEARNED))
    s.advance_to(1_000 * MS)
    for shape, cost in costs_ms.items():
        s.estimates.observe(shape, cost * MS, s.now_ns)
    return s


def decoders(s: Scheduler, n: int, means: tuple[float, ...] = (0.95, 0.9)
             ) -> list[RequestHandle]:
    out = []
    for _ in range(n):
        h = s.admit(prompt_len=64, max_output_tokens=500)
        rec = s.request(h)
        rec.phase, rec.prompt_cursor, rec.output_committed = Phase.DECODE, 64, 1
        rec.last_visible_ns = s.now_ns - 5 * MS
        s.preseed_acceptance(h, means)
        out.append(h)
    return out


def timing(ms: int) -> ExecutionTiming:
    return ExecutionTiming(device_intervals_ns=(ms * MS,), wall_ns=ms * MS)


# A wider mixed program costing about what a separate round does: the prompt rides along.
CHEAP_MIXED = {DECODE4: 10, PREFILL64: 10, spec(1): 10, spec(3): 12, mixed(1): 14,
               mixed(3): 13}


def test_mix_18_a_prompt_row_rides_with_speculative_decoders() -> None:
    """Covers MIX-18, MIX-20, MIX-43, VER-13: with a prompt waiting and a wider mixed
    program about as cheap as a separate round, the plan is the mixed program: the
    prompt lane first (``prefill_row`` 0), then the best ``B - 1`` decoders at full
    width (``P - chunk`` rows still hold them), decode mode speculative; it needs an
    empty window (MIX-31)."""
    s = scheduler(CHEAP_MIXED)
    hs = decoders(s, 3)
    prompt = s.admit(prompt_len=40, max_output_tokens=50)
    plan = s.plan()
    assert plan is not None and plan.shape == mixed(3)
    assert plan.step.mixed == MixedRole(prefill_row=0, decode_mode=DecodeMode.SPECULATIVE)
    first, *rest = plan.lanes
    assert (first.handle, first.role, first.prompt_tokens, first.token_ceiling) == (
        prompt, LaneRole.PROMPT, 40, 1)  # the chunk ends the prompt: one first token
    assert {lane.handle for lane in rest} == set(hs)
    assert all(lane.role is LaneRole.DECODE and lane.token_ceiling == 3 for lane in rest)
    assert plan.requires_empty_window and plan.reason is SelectionReason.ORDINARY


def test_mix_42_measured_durations_decide_between_mixed_and_separate() -> None:
    """Covers MIX-42 (no static preference): the same state with an expensive wider
    mixed program plans the separate round instead."""
    s = scheduler({**CHEAP_MIXED, mixed(3): 60})
    decoders(s, 3)
    s.admit(prompt_len=40, max_output_tokens=50)
    plan = s.plan()
    assert plan is not None and plan.shape != mixed(3)


def test_dur_22_an_unmeasured_wider_mixed_program_is_discovered() -> None:
    """Covers DUR-22, DUR-23: an unknown wider mixed program ranks first by useful value
    (reason discovery, empty window)."""
    costs = dict(CHEAP_MIXED)
    del costs[mixed(3)]
    s = scheduler(costs)
    decoders(s, 2)
    s.admit(prompt_len=40, max_output_tokens=50)
    plan = s.plan()
    assert plan is not None and plan.shape == mixed(3)
    assert plan.reason is SelectionReason.DISCOVERY and not plan.duration_known


def test_mix_18_a_long_prompt_sends_a_capacity_chunk_without_a_first_token() -> None:
    """Covers MIX-18, SEL-39: the chunk is capped at ``C``; not reaching the prompt end,
    the prompt lane emits nothing (ceiling 0)."""
    s = scheduler(CHEAP_MIXED)
    decoders(s, 3)
    s.admit(prompt_len=200, max_output_tokens=50)
    plan = s.plan()
    assert plan is not None and plan.shape == mixed(3)
    first = plan.lanes[0]
    assert (first.role, first.prompt_tokens, first.token_ceiling) == (LaneRole.PROMPT, 64, 0)


def test_mix_30_mixed_decode_rows_learn_acceptance_and_the_prompt_row_does_not() -> None:
    """Covers MIX-28..30, ACC-6, ACC-7, VER-13: completing a speculative mixed frame
    commits the prompt extent and its first token, each decode lane's accepted prefix,
    and folds the decode lanes' rounds into their acceptance (a rejection at depth 2
    lowers that mean); the prompt request gets no acceptance observation."""
    s = scheduler(CHEAP_MIXED)
    hs = decoders(s, 3)
    prompt = s.admit(prompt_len=40, max_output_tokens=50)
    plan = s.plan()
    assert plan is not None and plan.shape == mixed(3)
    s.commit(plan, Fence(1))
    records = [CompletionRecord(handle=prompt, epoch=plan.lanes[0].epoch, token_ids=(5,),
                                prompt_tokens=40)]
    records += [CompletionRecord(handle=lane.handle, epoch=lane.epoch, token_ids=(7, 8))
                for lane in plan.lanes[1:]]
    out = s.complete(Fence(1), records, timing(13), round=RoundCompletion(lanes=tuple(
        RoundLaneOutcome(handle=h, proposed=2, evaluated=2, accepted=1) for h in hs)))
    assert {t.handle for t in out} == {prompt, *hs}
    assert s.request(prompt).phase is Phase.DECODE and s.request(prompt).output_committed == 1
    assert all(s.request(h).output_committed == 3 for h in hs)
    learned = s.acceptance(hs[0]).acceptance(ProposalSource.LEARNED)
    assert learned.mean(1) > 0.95 and learned.mean(2) < 0.9
    fresh = s.acceptance(prompt).acceptance(ProposalSource.LEARNED)
    assert fresh.weight(1) <= INITIAL_WEIGHT  # aged by its first token, never observed


def test_mix_6_width_one_draft_maintaining_mixed_competes_in_ordinary_selection() -> None:
    """Covers MIX-6, MIX-35: in a speculative load the width-one mixed programs keep the
    draft context; ordinary selection plans them (decode mode ordinary) when they win,
    here with low acceptance making every speculative round worse than one row."""
    s = scheduler({**CHEAP_MIXED, mixed(1): 10, mixed(3): 60, spec(3): 60})
    decoders(s, 3, means=(0.01, 0.0))
    s.admit(prompt_len=40, max_output_tokens=50)
    plan = s.plan()
    assert plan is not None and plan.shape == mixed(1)
    assert plan.step.mixed == MixedRole(prefill_row=0, decode_mode=DecodeMode.ORDINARY)


def test_wider_mixed_shapes_are_the_speculative_ones_above_width_one() -> None:
    assert wider_mixed_shapes(CATALOG) == [mixed(3)]


def test_ref_8_a_stale_wider_mixed_program_is_the_funded_refresh_choice() -> None:
    """Covers REF-7, REF-8, MIX-42: with full refresh credit, the least recently touched
    stale program is refreshed even when it is a wider mixed program (a prompt chunk
    beside speculative decode rows), in place of the measured winner."""
    s = scheduler({**CHEAP_MIXED, mixed(3): 60})
    stale_shape = mixed(3)
    stale_except(s, stale_shape)
    decoders(s, 3)
    s.admit(prompt_len=40, max_output_tokens=50)
    plan = funded_refresh(s, stale_shape)
    assert plan.reason is SelectionReason.TIMING_REFRESH
    assert plan.shape == stale_shape and plan.requires_empty_window
    assert plan.step.mixed == MixedRole(prefill_row=0, decode_mode=DecodeMode.SPECULATIVE)
