"""``policy.lifecycle``: the rules the seed's Scheduler and the baselines share.

Covers SEL-1, SEL-40 (admission), QUEUE-6, QUEUE-7 (commit rechecks), ACCT-6 (every
lane validated before any update) and the output accounting of a valid lane.
"""

from __future__ import annotations

import pytest

from policy.lifecycle import (
    apply_progress,
    check_admission,
    check_lane,
    index_records,
    lane_valid,
)
from policy.requests import RequestRecord
from policy.service import ServiceHistory
from policy.types import (
    AdmissionRefused,
    CompletionRecord,
    FinishKind,
    Lane,
    LaneRole,
    Phase,
    RequestHandle,
    StaleEpochError,
    StalePlanError,
)

H = RequestHandle(1)


def record(**kw: object) -> RequestRecord:
    fields: dict[str, object] = dict(handle=H, epoch=0, admitted_ns=0, prompt_len=10,
                                     cached_prefix_len=0, max_output_tokens=4,
                                     history=ServiceHistory(1.0, None))
    fields.update(kw)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def test_admission_checks_and_sorted_message_ends() -> None:
    assert check_admission(prompt_len=10, max_output_tokens=1, cached_prefix_len=9,
                           message_ends=(7, 3, 7), system_end=10).message_ends == (3, 7)
    for kw in (dict(prompt_len=0), dict(max_output_tokens=0), dict(cached_prefix_len=10),
               dict(message_ends=(11,)), dict(system_end=0)):
        args: dict[str, object] = dict(prompt_len=10, max_output_tokens=1,
                                       cached_prefix_len=0, message_ends=(), system_end=None)
        args.update(kw)
        with pytest.raises(AdmissionRefused):
            check_admission(**args)  # type: ignore[arg-type]


def test_lane_rechecks() -> None:
    prompt = Lane(handle=H, epoch=0, role=LaneRole.PROMPT, prompt_start=0, prompt_tokens=10,
                  token_ceiling=1)
    check_lane(record(), prompt)
    with pytest.raises(StaleEpochError):
        check_lane(record(epoch=1), prompt)
    with pytest.raises(StaleEpochError):
        check_lane(None, prompt)
    with pytest.raises(StalePlanError):
        check_lane(record(prompt_cursor=2), prompt)
    with pytest.raises(StalePlanError):  # past the prompt end
        check_lane(record(prompt_len=9), prompt)
    decode = Lane(handle=H, epoch=0, role=LaneRole.DECODE, token_ceiling=3)
    check_lane(record(phase=Phase.DECODE, output_committed=1), decode)
    with pytest.raises(StalePlanError):  # output room 2 < ceiling 3 (queued work counts)
        check_lane(record(phase=Phase.DECODE, output_committed=1, queued_outputs=1), decode)


def test_lane_validation_before_any_update() -> None:
    decode = Lane(handle=H, epoch=0, role=LaneRole.DECODE, token_ceiling=3)
    good = CompletionRecord(handle=H, epoch=0, token_ids=(1, 2))
    by_handle, duplicates = index_records([good])
    assert lane_valid(decode, by_handle[H], duplicates)
    assert not lane_valid(decode, CompletionRecord(handle=H, epoch=0, token_ids=()), set())
    assert not lane_valid(decode, CompletionRecord(handle=H, epoch=0, token_ids=(1,) * 4),
                          set())
    assert not lane_valid(decode, CompletionRecord(handle=H, epoch=1, token_ids=(1,)), set())
    _, duplicates = index_records([good, good])
    assert duplicates == {H} and not lane_valid(decode, good, duplicates)
    chunk = Lane(handle=H, epoch=0, role=LaneRole.PROMPT, prompt_tokens=5)
    assert lane_valid(chunk, CompletionRecord(handle=H, epoch=0, prompt_tokens=5), set())
    assert not lane_valid(chunk, CompletionRecord(handle=H, epoch=0, prompt_tokens=4), set())


def test_progress_of_prompt_and_output_lanes() -> None:
    rec = record(prompt_len=8)
    half = Lane(handle=H, epoch=0, role=LaneRole.PROMPT, prompt_start=0, prompt_tokens=5)
    assert apply_progress(rec, half, CompletionRecord(handle=H, epoch=0, prompt_tokens=5)) \
        == (False, False, None)
    rest = Lane(handle=H, epoch=0, role=LaneRole.PROMPT, prompt_start=5, prompt_tokens=3,
                token_ceiling=1)
    out = apply_progress(rec, rest, CompletionRecord(handle=H, epoch=0, token_ids=(9,),
                                                     prompt_tokens=3))
    assert out == (True, True, None) and rec.phase is Phase.DECODE
    burst = Lane(handle=H, epoch=0, role=LaneRole.DECODE, token_ceiling=3)
    out = apply_progress(rec, burst, CompletionRecord(handle=H, epoch=0, token_ids=(1, 2, 3)))
    assert out.finish is FinishKind.LENGTH and rec.output_committed == 4
    rec = record(phase=Phase.DECODE)
    out = apply_progress(rec, burst, CompletionRecord(handle=H, epoch=0, token_ids=(1,),
                                                      terminated=True))
    assert out.finish is FinishKind.STOP
