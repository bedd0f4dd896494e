"""Mixed frames with speculative decode rows in the runtime, without a device: packing
(``actors.frame_inputs``), validation (``actors.completion_validator``), completion
routing (``actors.planner``) and the served catalog (``actors.catalog_setup.served_shapes``).

Plans are built by hand in the format the speculating ``Scheduler`` produces: the prompt
lane first (``MixedRole(prefill_row=0, decode_mode=SPECULATIVE)``) or none
(``prefill_row=-1``), then decode lanes whose ``token_ceiling`` is the host query
length. Covers MIX-6, MIX-7, MIX-9, MIX-26, MIX-28, MIX-29, MIX-30, MIX-43, VER-13,
VER-28.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np
import pytest
import trio

from actors.catalog_setup import served_shapes
from actors.completion_validator import FrameCheck, check_frame
from actors.config import RuntimeConfig
from actors.frame_inputs import (
    LaneSource,
    PackingError,
    kv_extent,
    mark_submitted,
    pack_frame,
    settle_decodes,
)
from actors.messages import (
    Fence,
    FrameOrder,
    FrameOutcome,
    PageId,
    PagePlan,
    RequestHandle,
    StateRow,
    ValidatedFrame,
)
from actors.planner import Planner
from actors.public import GenerationRequest
from gpu.backends.protocol import Completion
from gpu.catalog import CatalogFlags, build_catalog
from gpu.frames import GREEDY, RESULT_KEY, LaneSample, MixedFrame, PageAppend, RowInit
from gpu.programs.speculative_frames import (
    SpeculativeLane,
    SpeculativeMixedFrame,
    SpeculativeMixedResult,
    SpeculativeResult,
)
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape
from policy.protocol import RoundCompletion
from policy.round_speculation import SpeculationSettings
from policy.scheduler import Scheduler
from policy.types import (
    CompletionRecord,
    DecodeMode,
    GeneratedToken,
    Lane,
    LaneRole,
    MixedRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)

WIDE = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=3, proposal_depth=2,
                  prefill_capacity=64, packed_capacity=64 + 3 * 3, speculation_enabled=True)
"""A wider speculative mixed shape: B=4, W=3, C=64, P=73."""
ONE = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=1,
                 prefill_capacity=64, packed_capacity=67)
"""An ordinary width-one mixed shape."""
TIMING = ExecutionTiming(device_intervals_ns=(1_000,), wall_ns=2_000)
EOS = 2
PROMPT = tuple(range(10, 30))  # the prompt lane's request: 20 tokens


def plan(shape: GraphShape, lanes: tuple[Lane, ...],
         mode: DecodeMode = DecodeMode.SPECULATIVE) -> ScheduledPlan:
    prefill_row = next((i for i, lane in enumerate(lanes) if lane.role is LaneRole.PROMPT),
                       -1)
    return ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=lanes,
                           mixed=MixedRole(prefill_row=prefill_row, decode_mode=mode)),
        estimated_duration_ns=1_000, scaled_score=1.0, scale_exponent=0, duration_known=True,
        stale=False, reason=SelectionReason.ORDINARY, requires_empty_window=False,
        planned_at_ns=0, start_ns=0, useful_value=1.0)


def prompt_lane(start: int, tokens: int, handle: int = 0) -> Lane:
    ends = start + tokens == len(PROMPT)
    return Lane(handle=RequestHandle(handle), epoch=1, role=LaneRole.PROMPT,
                prompt_start=start, prompt_tokens=tokens, token_ceiling=int(ends))


def decode_lane(handle: int, ceiling: int) -> Lane:
    return Lane(handle=RequestHandle(handle), epoch=1, role=LaneRole.DECODE,
                token_ceiling=ceiling)


def source(handle: int, prompt: tuple[int, ...], *, decoding: bool) -> LaneSource:
    """Request ``handle`` on state row ``handle + 4``; a decoding one is initialised and
    has its prompt's first token."""
    return LaneSource(
        handle=RequestHandle(handle), epoch=1, row=StateRow(handle + 4),
        request=GenerationRequest(prompt_token_ids=prompt, max_tokens=16),
        cached_tokens=0, cached_pages=(), sampling=GREEDY, eos_token_ids=(EOS,),
        initialised=decoding, output_ids=[7] if decoding else [])


def sources() -> dict[RequestHandle, LaneSource]:
    return {RequestHandle(0): source(0, PROMPT, decoding=False),
            RequestHandle(1): source(1, (3, 4, 5), decoding=True),
            RequestHandle(2): source(2, (6, 7), decoding=True)}


# ------------------------------------------------------------------------- packing


def test_mix_9_ver_28_prompt_and_decode_lanes_pack_a_speculative_mixed_frame() -> None:
    """The prompt lane sits at ``prefill_row`` 0 with limit 0 and its chunk; decode
    lanes carry their host query lengths; row initialisation and reserved pages ride
    with the frame; the prompt lane samples exactly when its chunk ends the prompt."""
    lanes = (prompt_lane(8, 12), decode_lane(1, 3), decode_lane(2, 1))
    table = sources()
    pages = [PagePlan(handle=RequestHandle(0), row=StateRow(4), first_block=0,
                      page_ids=(PageId(3), PageId(5))),
             PagePlan(handle=RequestHandle(1), row=StateRow(5), first_block=1,
                      page_ids=(PageId(9),))]
    frame, contexts = pack_frame(plan(WIDE, lanes), table, pages)
    assert isinstance(frame, SpeculativeMixedFrame)
    assert frame.rows == (4, 5, 6) and frame.limits == (0, 3, 1)
    assert frame.prefill_row == 0
    assert frame.prompt_tokens == PROMPT[8:20] and frame.prompt_start == 8
    assert frame.prompt_ends
    assert frame.updates == (
        RowInit(row=4, position=0, sampling=GREEDY, top_logprobs=0),
        PageAppend(row=4, first_block=0, page_ids=(3, 5)),
        PageAppend(row=5, first_block=1, page_ids=(9,)))
    assert [c.samples for c in contexts] == [True, True, True]
    assert [c.row for c in contexts] == [4, 5, 6]

    frame, contexts = pack_frame(plan(WIDE, (prompt_lane(0, 8), decode_lane(1, 2))),
                                 table, [])
    assert isinstance(frame, SpeculativeMixedFrame)
    assert frame.prompt_tokens == PROMPT[:8] and not frame.prompt_ends
    assert frame.limits == (0, 2) and [c.samples for c in contexts] == [False, True]


def test_mix_17_a_decode_only_speculative_mixed_plan_has_no_prompt_row() -> None:
    """Decode-only (``prefill_row`` -1): every lane is a decode lane at its length, and
    its reserved extent and settlement follow the lane's ceiling like a round's."""
    lanes = (decode_lane(1, 3), decode_lane(2, 3))
    table = sources()
    frame, contexts = pack_frame(plan(WIDE, lanes), table, [])
    assert isinstance(frame, SpeculativeMixedFrame)
    assert frame.prefill_row == -1 and frame.prompt_tokens == ()
    assert frame.limits == (3, 3) and frame.rows == (5, 6) and frame.updates == ()
    assert all(c.samples for c in contexts)
    one = table[RequestHandle(1)]
    assert kv_extent(lanes[0], one) == 3 + 0 + 3
    mark_submitted(plan(WIDE, lanes), table)
    assert one.decodes_submitted == 3
    settle_decodes(lanes[0], one, emitted=2)  # one draft rejected
    assert one.decodes_submitted == 2


def test_ordinary_mixed_plans_still_pack_a_mixed_frame() -> None:
    """A width-one ordinary mixed plan is unchanged: a ``MixedFrame``."""
    lanes = (prompt_lane(8, 12), decode_lane(1, 1))
    frame, _ = pack_frame(plan(ONE, lanes, DecodeMode.ORDINARY), sources(), [])
    assert isinstance(frame, MixedFrame)
    assert frame.rows == (4, 5) and frame.prefill_row == 0 and frame.prompt_ends


def test_a_decode_mode_that_does_not_match_the_program_is_a_packing_error() -> None:
    """Each program takes one frame type: speculative rows on a width-one program, or
    ordinary rows on a wider speculative program, is a planning bug raised loudly."""
    lanes = (decode_lane(1, 1),)
    with pytest.raises(PackingError, match="decode mode"):
        pack_frame(plan(ONE, lanes), sources(), [])
    with pytest.raises(PackingError, match="decode mode"):
        pack_frame(plan(WIDE, lanes, DecodeMode.ORDINARY), sources(), [])


# ---------------------------------------------------------------------- validation


def order(lanes: tuple[Lane, ...]) -> FrameOrder:
    committed = plan(WIDE, lanes)
    frame, contexts = pack_frame(committed, sources(), [])
    return FrameOrder(fence=Fence(5), plan=committed, frame=frame, lanes=contexts)


def spec(row: int, tokens: tuple[int, ...], *, evaluated: int = 2, rows: int = 3,
         proposal: int = -1) -> SpeculativeLane:
    return SpeculativeLane(
        row=row, tokens=tokens, logprobs=tuple(-0.5 for _ in tokens),
        top_logprobs=tuple(() for _ in tokens), finite=True, accepted=len(tokens) - 1,
        evaluated=evaluated, target_rows=rows, proposed=evaluated,
        survival=tuple(0.5 for _ in range(evaluated)), draft_proposal=proposal)


def check(o: FrameOrder, rounds: tuple[SpeculativeLane, ...],
          first: LaneSample | None = None) -> FrameCheck:
    result = SpeculativeMixedResult(
        speculative=SpeculativeResult(lanes=rounds,
                                      confidence=np.full((2, 4, 2), 0.25, np.float32),
                                      survival=np.zeros((4, 2), np.float32)),
        prompt_sample=first)
    return check_frame(o, FrameOutcome(
        order=o, completion=Completion(shape=WIDE, outputs={RESULT_KEY: result},
                                       timing=TIMING),
        fault=None, wall_ns=2_000), vocab_size=50)


def sample(token: int = 8, row: int = 4) -> LaneSample:
    return LaneSample(row=row, token=token, logprob=-0.25, finite=True)


def test_mix_26_mix_28_mix_29_each_lane_is_recorded_by_its_phase() -> None:
    """The prompt lane commits its chunk and its first token; decode lanes commit their
    accepted prefixes (cut after EOS); records follow plan order; the decode lanes'
    rounds (survival, offered drafts) and width-one draft proposals go to completion."""
    o = order((prompt_lane(8, 12), decode_lane(1, 3), decode_lane(2, 1)))
    c = check(o, (spec(5, (11, EOS, 13)), spec(6, (14,), evaluated=0, rows=1, proposal=21)),
              sample())
    assert c.failures == ()
    assert [r.token_ids for r in c.records] == [(8,), (11, EOS), (14,)]
    assert [r.prompt_tokens for r in c.records] == [12, 0, 0]
    assert [r.terminated for r in c.records] == [False, True, False]
    assert c.logprobs == ((-0.25,), (-0.5, -0.5), (-0.5,))
    assert c.rounds is not None
    assert [(r.handle, r.accepted, r.evaluated, r.survival) for r in c.rounds.lanes] == [
        (1, 2, 2, (0.5, 0.5)), (2, 0, 0, ())]
    assert c.rounds.confidence[0][3] == (0.25, 0.25)
    assert c.draft_proposals == ((RequestHandle(2), 21),)


def test_mix_28_a_first_token_that_is_eos_terminates_the_prompt_lane() -> None:
    o = order((prompt_lane(8, 12), decode_lane(1, 2)))
    c = check(o, (spec(5, (11,), evaluated=1, rows=2),), sample(EOS))
    assert c.records[0].token_ids == (EOS,) and c.records[0].terminated


def test_mix_27_a_chunk_before_the_prompt_end_commits_only_its_tokens() -> None:
    o = order((prompt_lane(0, 8), decode_lane(1, 2)))
    c = check(o, (spec(5, (11, 12), evaluated=1, rows=2),))
    assert c.failures == ()
    assert c.records[0] == CompletionRecord(handle=RequestHandle(0), epoch=1, token_ids=(),
                                            prompt_tokens=8)
    assert c.records[1].token_ids == (11, 12)


def test_acct_6_a_decode_lane_over_its_ceiling_fails_alone() -> None:
    """Lane 1's query length is 2 (one draft); three tokens exceed it."""
    o = order((prompt_lane(8, 12), decode_lane(1, 2), decode_lane(2, 3)))
    c = check(o, (spec(5, (11, 12, 13)), spec(6, (14, 15))), sample())
    assert [r.ok for r in c.records] == [True, False, True]
    assert len(c.failures) == 1 and c.failures[0].handle == RequestHandle(1)
    assert "ceiling" in c.failures[0].message
    assert c.records[0].token_ids == (8,) and c.records[2].token_ids == (14, 15)
    assert c.rounds is not None and [r.handle for r in c.rounds.lanes] == [2]


def test_mix_28_a_last_chunk_without_its_first_token_fails_alone() -> None:
    o = order((prompt_lane(8, 12), decode_lane(1, 2)))
    c = check(o, (spec(5, (11, 12), evaluated=1, rows=2),))
    assert [r.ok for r in c.records] == [False, True]
    assert c.failures[0].handle == RequestHandle(0)
    assert "first token" in c.failures[0].message
    assert c.rounds is not None and [r.handle for r in c.rounds.lanes] == [1]


def test_a_first_token_before_the_prompt_end_or_a_bad_one_fails_the_prompt_lane() -> None:
    o = order((prompt_lane(0, 8), decode_lane(1, 2)))
    c = check(o, (spec(5, (11,), evaluated=1, rows=2),), sample())
    assert [r.ok for r in c.records] == [False, True]
    o = order((prompt_lane(8, 12), decode_lane(1, 2)))
    for bad, message in ((sample(token=50), "vocabulary"), (sample(row=5), "row")):
        c = check(o, (spec(5, (11,), evaluated=1, rows=2),), bad)
        assert [r.ok for r in c.records] == [False, True] and message in c.failures[0].message


def test_queue_47_the_chunk_and_target_rows_beyond_p_fail_the_frame() -> None:
    """P = 73: a 64-token chunk leaves 9 target rows; 10 fail every lane (the rows
    alone would fit P), 9 pass."""
    table = sources()
    long_prompt = tuple(range(3, 67))
    table[RequestHandle(0)] = source(0, long_prompt, decoding=False)
    chunk = Lane(handle=RequestHandle(0), epoch=1, role=LaneRole.PROMPT, prompt_start=0,
                 prompt_tokens=64, token_ceiling=1)
    committed = plan(WIDE, (chunk, decode_lane(1, 3), decode_lane(2, 3)))
    frame, contexts = pack_frame(committed, table, [])
    o = FrameOrder(fence=Fence(5), plan=committed, frame=frame, lanes=contexts)
    c = check(o, (spec(5, (11,), rows=5), spec(6, (12,), rows=5)), sample())
    assert not any(r.ok for r in c.records) and "P=73" in c.failures[0].message
    c = check(o, (spec(5, (11,), rows=5), spec(6, (12,), rows=4)), sample())
    assert all(r.ok for r in c.records)


def test_a_missing_result_or_round_fails_the_frame() -> None:
    o = order((prompt_lane(8, 12), decode_lane(1, 2), decode_lane(2, 2)))
    c = check(o, (spec(5, (11,), evaluated=1, rows=2),), sample())  # one round of two
    assert not any(r.ok for r in c.records) and "decode lanes" in c.failures[0].message
    plain = SpeculativeResult(lanes=(), confidence=np.zeros((2, 4, 2), np.float32),
                              survival=np.zeros((4, 2), np.float32))
    c = check_frame(o, FrameOutcome(
        order=o, completion=Completion(shape=WIDE, outputs={RESULT_KEY: plain}, timing=TIMING),
        fault=None, wall_ns=1), vocab_size=50)
    assert not any(r.ok for r in c.records) and "no result" in c.failures[0].message
    decode_only = order((decode_lane(1, 2),))
    c = check(decode_only, (spec(5, (11,), evaluated=1, rows=2),), sample())
    assert not c.records[0].ok and "without a prompt lane" in c.failures[0].message


def test_a_decode_only_frame_validates_like_a_round() -> None:
    o = order((decode_lane(1, 3), decode_lane(2, 3)))
    c = check(o, (spec(5, (11, 12, 13)), spec(6, (14,))))
    assert [r.token_ids for r in c.records] == [(11, 12, 13), (14,)]
    assert c.rounds is not None and len(c.rounds.lanes) == 2


# ----------------------------------------------------------- completion routing


class RecordingScheduler(Scheduler):
    """Records what the planner completes frames with."""

    def __init__(self) -> None:
        super().__init__(catalog=(WIDE,), speculation=SpeculationSettings())
        self.calls: list[RoundCompletion | None] = []

    def complete(self, fence: Fence, records: Sequence[CompletionRecord],
                 timing: ExecutionTiming, *, round: RoundCompletion | None = None
                 ) -> list[GeneratedToken]:
        self.calls.append(round)
        return []


def test_mix_30_a_validated_speculative_mixed_frame_completes_with_survival() -> None:
    """The planner hands the decode lanes' survival and offered drafts to ``complete``,
    as for a separate round (ACC-28, MIX-30)."""
    o = order((prompt_lane(8, 12), decode_lane(1, 3), decode_lane(2, 1)))
    c = check(o, (spec(5, (11, 12)), spec(6, (14,), evaluated=0, rows=1)), sample())
    scheduler = RecordingScheduler()
    send, _receive = trio.open_memory_channel[object](1)
    planner = Planner(scheduler, to_dispatcher=send, to_publisher=send,
                      to_allocator=send, eos_token_ids=(EOS,), clock_ns=lambda: 0)
    frame = ValidatedFrame(fence=o.fence, plan=o.plan, records=c.records,
                           failures=c.failures, timing=TIMING, logprobs=c.logprobs,
                           prompt_logprobs=None, rounds=c.rounds)
    planner._complete_in_scheduler(frame)
    [completed] = scheduler.calls
    assert completed is not None
    assert {lane.handle: (lane.survival, lane.evaluated) for lane in completed.lanes} == {
        RequestHandle(1): ((0.5, 0.5), 2), RequestHandle(2): ((), 0)}
    assert planner.counters.speculative_frames == 1
    assert planner.counters.accepted_tokens == 1


# ----------------------------------------------------------------- served shapes


def speculative_load(depth: int = 3) -> tuple[GraphShape, ...]:
    return build_catalog(CatalogFlags(max_batch=8, prefill_capacities=(64, 256),
                                      mixed_prefill=True, family_supports_mixed=True,
                                      draft_depth=depth)).shapes


def config(mode: str) -> RuntimeConfig:
    return RuntimeConfig(model_dir=pathlib.Path("."), speculation=mode)  # type: ignore[arg-type]


def test_mix_6_mix_43_adaptive_mode_serves_every_speculative_mixed_program() -> None:
    load = speculative_load()
    served = served_shapes(load, config("adaptive"))
    assert served == load
    wider = {(s.batch_capacity, s.token_capacity) for s in served
             if s.kind is GraphKind.MIXED and s.token_capacity > 1}
    assert wider == {(b, w) for b in (2, 4, 8) for w in (2, 3, 4)}
    assert all(s.speculation_enabled for s in served if s.kind is GraphKind.MIXED)
    assert any(s.kind is GraphKind.MIXED and s.token_capacity == 1 for s in served)


def test_mix_7_fixed_mode_keeps_only_the_fixed_width_mixed_and_separate_programs() -> None:
    """Fixed W = D + 1 = 4 excludes every other width, mixed (width one included) and
    separate speculative alike; prefill programs stay, and so do the ordinary decode
    programs constrained requests decode on (SEL-13)."""
    load = speculative_load()
    served = served_shapes(load, config("fixed"))
    mixed = [s for s in served if s.kind is GraphKind.MIXED]
    assert {(s.batch_capacity, s.token_capacity) for s in mixed} == {(2, 4), (4, 4), (8, 4)}
    assert {s.token_capacity for s in served if s.kind is GraphKind.SPECULATIVE} == {4}
    assert [s for s in served if s.kind is GraphKind.DECODE] == \
        [s for s in load if s.kind is GraphKind.DECODE] != []
    assert [s for s in served if s.kind is GraphKind.PREFILL] == \
        [s for s in load if s.kind is GraphKind.PREFILL]
