"""flare's extension: a request admitted with ``decode_prompt_tail`` (its uncached
prompt is one token) starts in DECODE with its prompt consumed, and its first decode
step publishes its first output (``policy.lifecycle.decodes_prompt_tail``). Without it
the seed's path stands: the token is a one-token prompt chunk (SEL-1)."""

from __future__ import annotations

import pytest
from synthetic_catalog import Driver, measured_scheduler, ordinary_catalog

from policy import (
    AdmissionRefused,
    FinishKind,
    GraphKind,
    LaneRole,
    Phase,
    RestoreNeed,
    Scheduler,
    make_policy,
)
from policy.lifecycle import check_admission
from policy.protocol import SchedulingPolicy
from policy.vision_windows import ImagePlan

POLICIES = ["balanced", "fcfs", "sarathi", "vtc"]


def policy_named(name: str) -> SchedulingPolicy:
    if name == "balanced":
        return measured_scheduler(ordinary_catalog())
    return make_policy(name, catalog=ordinary_catalog())


@pytest.mark.parametrize("name", POLICIES)
def test_a_one_token_remainder_decodes_its_first_output(name: str) -> None:
    s = policy_named(name)
    h = s.admit(prompt_len=40, cached_prefix_len=39, max_output_tokens=3,
                decode_prompt_tail=True)
    assert s.phase(h) is Phase.DECODE and s.request(h).prompt_cursor == 40
    d = Driver(s)  # type: ignore[arg-type]
    plan = d.step()
    assert plan is not None and plan.shape.kind is GraphKind.DECODE
    assert [(lane.handle, lane.role) for lane in plan.lanes] == [(h, LaneRole.DECODE)]
    first = d.trace.tokens[0][1]
    assert first.first and first.token_ids == (7,)
    d.run(5)
    outputs = [g for _, g in d.trace.tokens]
    assert [g.first for g in outputs] == [True, False, False]
    assert outputs[-1].finish is FinishKind.LENGTH
    assert all(p.shape.kind is GraphKind.DECODE for p in d.trace.plans)


@pytest.mark.parametrize("name", POLICIES)
def test_without_the_setting_the_remainder_is_a_prompt_chunk(name: str) -> None:
    s = policy_named(name)
    h = s.admit(prompt_len=40, cached_prefix_len=39, max_output_tokens=3)
    assert s.phase(h) is Phase.PREFILL
    plan = s.plan()
    assert plan is not None and plan.shape.kind is GraphKind.PREFILL
    (lane,) = plan.lanes
    assert lane.role is LaneRole.PROMPT and (lane.prompt_start, lane.prompt_tokens) == (39, 1)


def test_it_joins_the_decoders_frame() -> None:
    """Three decoders run; the new request rides their next decode frame."""
    s = measured_scheduler(ordinary_catalog())
    running = [s.admit(prompt_len=64, max_output_tokens=50) for _ in range(3)]
    d = Driver(s)
    while any(s.phase(h) is Phase.PREFILL for h in running):
        d.step()
    h = s.admit(prompt_len=64, cached_prefix_len=63, max_output_tokens=5,
                decode_prompt_tail=True)
    plan = s.plan()
    assert plan is not None and plan.shape.kind is GraphKind.DECODE
    assert set(plan.handles()) == {*running, h}


@pytest.mark.parametrize("kw", [
    dict(cached_prefix_len=38),
    dict(scored_prompt=True),
    dict(images=ImagePlan(spans=((2, 6),), window_images=1, atomic_capacity=64)),
    dict(restore=RestoreNeed.READY),
], ids=["two-tokens", "scored", "images", "restore"])
def test_only_a_plain_one_token_remainder_may_start_decoding(kw: dict[str, object]) -> None:
    args: dict[str, object] = dict(prompt_len=40, cached_prefix_len=39, max_output_tokens=3,
                                   decode_prompt_tail=True)
    args.update(kw)
    s = Scheduler(None, ordinary_catalog())
    with pytest.raises(AdmissionRefused, match="one-token"):
        s.admit(**args)  # type: ignore[arg-type]
    assert s.handles() == ()


def test_the_admission_check_says_where_a_request_starts() -> None:
    base = dict(prompt_len=1, max_output_tokens=2, cached_prefix_len=0, message_ends=(),
                system_end=None)
    assert check_admission(**base) == ((), Phase.PREFILL, 0)  # type: ignore[arg-type]
    assert check_admission(**base, decode_prompt_tail=True) == (  # type: ignore[arg-type]
        (), Phase.DECODE, 1)
