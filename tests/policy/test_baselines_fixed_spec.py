"""``fixed-spec-K``: every decode batch a complete speculative round at depth K.

Covers the ``fixed-spec-k`` speculative baselines: the defining behaviour (every
generation frame is a QueryLength speculative program of width K + 1, each lane asking
for ``min(K + 1, output room)`` target rows, SPEC-19, SPEC-25), rounds never exceed the
program's B or P (QUEUE-47) nor the token budget, prompts are chunked under the budget
and alternate with rounds, rounds queue behind rounds but prompts drain the window
(QUEUE-11, QUEUE-12), partial acceptance commits only the emitted tokens and queued
rounds respect output room (QUEUE-48), and the catalog rules (no speculative programs:
``sarathi``; too shallow: refused).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_baselines_fcfs import CATALOG, decode, prefill

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    FinishKind,
    GraphKind,
    GraphShape,
    LaneRole,
    ScheduledPlan,
    WindowNotReady,
)
from policy.baselines import (
    FixedSpecPolicy,
    SarathiPolicy,
    make_policy,
    speculative_policy,
)
from policy.config import PolicyConfigError
from policy.descriptors import TargetBinding
from policy.types import PolicyError

MS = 1_000_000


def spec(b: int, w: int, p: int | None = None,
         binding: TargetBinding = TargetBinding.QUERY_LENGTH) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=p if p is not None else b * w,
                      binding=binding)


SPECULATIVE = tuple(spec(b, w) for b in (1, 2, 4) for w in range(1, 6))
SPEC_CATALOG = CATALOG + SPECULATIVE

Emit = Callable[[int, int], int]
"""(lane index, host length) -> tokens the round emits for that lane."""


def run(policy: FixedSpecPolicy | SarathiPolicy, frames: int,
        emit: Emit = lambda _i, rows: rows) -> list[ScheduledPlan]:
    """Plan, commit and complete one frame at a time; ``emit`` decides acceptance."""
    plans: list[ScheduledPlan] = []
    now = 0
    for fence in range(1, frames + 1):
        plan = policy.plan()
        if plan is None:
            break
        policy.commit(plan, Fence(fence))
        plans.append(plan)
        now += MS
        policy.advance_to(now)
        records = []
        for i, lane in enumerate(plan.lanes):
            tokens = emit(i, lane.token_ceiling) if lane.role is LaneRole.DECODE \
                else lane.token_ceiling
            records.append(CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                            token_ids=(5,) * tokens,
                                            prompt_tokens=lane.prompt_tokens))
        policy.complete(Fence(fence), records,
                        ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS))
    return plans


def generation(plans: list[ScheduledPlan]) -> list[ScheduledPlan]:
    return [p for p in plans if p.shape.is_generation]


def test_every_decode_batch_is_a_round_of_width_k_plus_one() -> None:
    """Three requests, fixed-spec-2: every generation frame is a QueryLength W=3
    program (never an ordinary decode, never another width) on the smallest bucket
    holding its lanes, and each request's lanes ask for 3 rows (7 tokens: 1 from
    prefill, then two rounds of 3)."""
    p = FixedSpecPolicy(catalog=SPEC_CATALOG, depth=2)
    handles = [p.admit(prompt_len=n, max_output_tokens=7) for n in (30, 40, 50)]
    rounds = generation(run(p, 40))
    assert rounds and all(r.shape.kind is GraphKind.SPECULATIVE for r in rounds)
    assert {r.shape.token_capacity for r in rounds} == {3}
    assert all(r.shape.binding is TargetBinding.QUERY_LENGTH for r in rounds)
    for h in handles:
        assert [ln.token_ceiling for r in rounds for ln in r.lanes if ln.handle == h] == [3, 3]
    for r in rounds:
        assert r.shape.batch_capacity == min(b for b in (1, 2, 4) if b >= len(r.lanes))
    assert max(len(r.lanes) for r in rounds) >= 2  # the streams share rounds
    assert p.take_released() == handles


def test_short_output_room_shortens_the_lane_not_the_program() -> None:
    """Output room 2 after the prompt's token: the lane asks for 2 rows on W=3."""
    p = FixedSpecPolicy(catalog=SPEC_CATALOG, depth=2)
    p.admit(prompt_len=10, max_output_tokens=3)
    rounds = generation(run(p, 10))
    assert [(r.shape.token_capacity, r.lanes[0].token_ceiling) for r in rounds] == [(3, 2)]


def test_partial_acceptance_commits_only_the_emitted_tokens() -> None:
    """Each round emits one token per lane (every draft rejected): one token per round,
    and each round asks for ``min(K + 1, room)`` rows of the room left."""
    p = FixedSpecPolicy(catalog=SPEC_CATALOG, depth=3)
    h = p.admit(prompt_len=10, max_output_tokens=6)
    rounds = generation(run(p, 20, emit=lambda _i, _rows: 1))
    assert [lane.token_ceiling for r in rounds for lane in r.lanes] == [4, 4, 3, 2, 1]
    assert {r.shape.token_capacity for r in rounds} == {4}
    assert p.take_released() == [h]


def test_rounds_never_exceed_b_or_p_and_every_stream_advances() -> None:
    """A ragged QueryLength program (B=4, W=3, P=7) holds at most two full lanes: four
    decoders share it round-robin, least recently served first (QUEUE-47)."""
    catalog = (prefill(64), decode(4), spec(4, 3, p=7))
    p = FixedSpecPolicy(catalog=catalog, depth=2)
    handles = [p.admit(prompt_len=20, max_output_tokens=40) for _ in range(4)]
    plans = run(p, 20)
    rounds = generation(plans)
    assert rounds
    for r in rounds:
        assert len(r.lanes) <= r.shape.batch_capacity
        assert sum(lane.token_ceiling for lane in r.lanes) <= r.shape.packed_capacity
    last_prompt = max(i for i, pl in enumerate(plans) if not pl.shape.is_generation)
    after = [tuple(lane.handle for lane in pl.lanes) for pl in plans[last_prompt + 1:]]
    assert all(len(cohort) == 2 for cohort in after[:6])
    for i in range(2, 6, 2):  # steady state: two consecutive rounds serve all four
        assert sorted(after[i] + after[i + 1]) == handles


def test_the_token_budget_bounds_prompt_chunks_and_rounds() -> None:
    """Budget 300: prompt chunks are cut to 256 (the largest capacity within it) and a
    round carries at most 300 rows; prompts and rounds alternate while both wait."""
    catalog = (prefill(64), prefill(256), prefill(1024), decode(1), decode(2),
               spec(1, 3), spec(2, 3))
    p = FixedSpecPolicy(catalog=catalog, depth=2, token_budget=300)
    p.admit(prompt_len=20, max_output_tokens=6)
    p.admit(prompt_len=900, max_output_tokens=4)
    plans = run(p, 40)
    prompts = [lane.prompt_tokens for pl in plans for lane in pl.lanes
               if lane.role is LaneRole.PROMPT]
    assert max(prompts) <= 256 and sum(prompts) == 920
    kinds = [pl.shape.kind.value[0] for pl in plans[:8]]
    # prompt 1, then request 1's two rounds alternate with request 2's chunks, whose
    # remaining chunks then run back to back (nothing else waits), then its rounds
    assert "".join(kinds) == "pspsppps"
    assert all(sum(lane.token_ceiling for lane in pl.lanes) <= 300 for pl in plans)


def test_a_round_queues_behind_a_round_within_output_room() -> None:
    """Two frames in flight: the second round's lanes ask only for the room the first
    left (QUEUE-11, QUEUE-48); a prompt does not queue behind a round (QUEUE-12)."""
    p = FixedSpecPolicy(catalog=SPEC_CATALOG, depth=2)
    h = p.admit(prompt_len=10, max_output_tokens=6)
    run(p, 1)  # prefill: one token committed, 5 left
    first = p.plan()
    assert first is not None and first.lanes[0].token_ceiling == 3
    p.commit(first, Fence(2))
    second = p.plan()
    assert second is not None and second.lanes[0].token_ceiling == 2
    assert p.window_ready(second)
    p.commit(second, Fence(3))
    assert p.plan() is None  # no room left while both are queued
    p.admit(prompt_len=10, max_output_tokens=2)
    assert p.in_flight() == (Fence(2), Fence(3))
    p.complete(Fence(2), [CompletionRecord(handle=h, epoch=0, token_ids=(5,))],
               ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS))
    prompt = p.plan()
    assert prompt is not None and prompt.shape.kind is GraphKind.PREFILL
    with pytest.raises(WindowNotReady):
        p.commit(prompt, Fence(4))


def test_final_token_inside_a_round_finishes_the_request() -> None:
    """A round whose emitted tokens reach max_output finishes by length; a terminated
    (EOS) lane finishes by stop even with rows left."""
    p = FixedSpecPolicy(catalog=SPEC_CATALOG, depth=4)
    a = p.admit(prompt_len=10, max_output_tokens=4)
    run(p, 1)
    plan = p.plan()
    assert plan is not None and plan.lanes[0].token_ceiling == 3
    p.commit(plan, Fence(2))
    out = p.complete(Fence(2), [CompletionRecord(handle=a, epoch=0, token_ids=(5, 6, 7))],
                     ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS))
    assert out[0].finish is FinishKind.LENGTH and out[0].token_ids == (5, 6, 7)
    b = p.admit(prompt_len=10, max_output_tokens=40)
    plan = p.plan()
    assert plan is not None
    p.commit(plan, Fence(3))
    p.complete(Fence(3), [CompletionRecord(handle=b, epoch=0, token_ids=(5,),
                                           prompt_tokens=10)],
               ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS))
    plan = p.plan()
    assert plan is not None and plan.lanes[0].token_ceiling == 5
    p.commit(plan, Fence(4))
    out = p.complete(Fence(4), [CompletionRecord(handle=b, epoch=0, token_ids=(5, 6),
                                                 terminated=True)],
                     ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS))
    assert out[0].finish is FinishKind.STOP


def test_without_speculative_programs_it_is_sarathi() -> None:
    """No speculative programs: the same plans as ``sarathi`` on the same requests."""
    plans = []
    for policy in (FixedSpecPolicy(catalog=CATALOG, depth=2), SarathiPolicy(catalog=CATALOG)):
        for n in (30, 300, 70):
            policy.admit(prompt_len=n, max_output_tokens=5)
        plans.append([(pl.shape, pl.lanes) for pl in run(policy, 50)])
    assert plans[0] == plans[1] and plans[0]


def test_catalog_rules() -> None:
    """Too shallow a speculative load is refused; device-allocated programs are not
    used; running slots are the widest round bucket's rows (max_num_seqs)."""
    shallow = (*CATALOG, spec(4, 1), spec(4, 2))
    with pytest.raises(PolicyError, match="depth >= 2"):
        FixedSpecPolicy(catalog=shallow, depth=2)
    FixedSpecPolicy(catalog=shallow, depth=1)
    device_only = (*CATALOG, spec(4, 3, p=8, binding=TargetBinding.SPECULATIVE_PREFIX_LIMIT))
    assert FixedSpecPolicy(catalog=device_only, depth=2).round_shapes == ()
    wide = (prefill(64), spec(1, 3), spec(2, 3), spec(8, 2))  # no ordinary decode at all
    p = FixedSpecPolicy(catalog=wide, depth=2)
    assert p.running_limit == 2
    assert [s.batch_capacity for s in p.round_shapes] == [1, 2]
    with pytest.raises(PolicyError, match="depth must be"):
        FixedSpecPolicy(catalog=SPEC_CATALOG, depth=0)


def test_names_select_the_depth() -> None:
    policy = make_policy("fixed-spec-3", catalog=SPEC_CATALOG, token_budget=128)
    assert isinstance(policy, FixedSpecPolicy)
    assert (policy.depth, policy.name, policy.token_budget) == (3, "fixed-spec-3", 128)
    assert speculative_policy("fixed-spec-3") and speculative_policy("spec-adaptive")
    assert not speculative_policy("sarathi")
    for bad in ("fixed-spec-0", "fixed-spec-8", "fixed-spec-k"):
        with pytest.raises(PolicyConfigError, match="unknown scheduler policy"):
            make_policy(bad)
