"""The host's share of reported logprobs, as pure decisions: which alternatives a request
keeps, how many output tokens a scored prompt is scheduled for, what its output stream
shows (nothing, with ``max_tokens`` 0), how alternatives stay aligned with the visible
tokens, and which requests admission refuses."""

from __future__ import annotations

from collections.abc import Sequence

from actors.admission import AdmissionLimits, check_request
from actors.public import TOP_LOGPROBS, GenerationRequest
from actors.reported_logprobs import kept_alternatives, scheduled_output_tokens
from actors.text_stream import OutputStream

EOS = 2
LIMITS = AdmissionLimits(max_context=64, vocab_size=100, max_queue=4)
PLACES = (((7, -0.1), (8, -0.5), (9, -2.0)), ((3, -0.2), (4, -0.3), (5, -0.9)))


def decode(ids: Sequence[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def stream(max_tokens: int) -> OutputStream:
    return OutputStream(decode=decode, max_tokens=max_tokens, eos_token_ids=(EOS,), stop=(),
                        ignore_eos=False)


def request(**kw: object) -> GenerationRequest:
    args: dict[str, object] = dict(prompt_token_ids=(5, 6, 7), max_tokens=4)
    args.update(kw)
    return GenerationRequest(**args)  # type: ignore[arg-type]


def test_a_request_keeps_the_first_k_alternatives_and_none_for_zero() -> None:
    assert kept_alternatives(PLACES, 2) == (PLACES[0][:2], PLACES[1][:2])
    assert kept_alternatives(PLACES, 3) == PLACES
    assert kept_alternatives(PLACES, 0) == ()


def test_a_scored_prompt_with_max_tokens_zero_is_scheduled_for_the_sample_it_ends_with() -> None:
    assert scheduled_output_tokens(request(max_tokens=0, prompt_logprobs=True)) == 1
    assert scheduled_output_tokens(request(max_tokens=5, prompt_logprobs=True)) == 5
    assert scheduled_output_tokens(request(max_tokens=5)) == 5


def test_max_tokens_zero_stream_discards_the_token_and_counts_none() -> None:
    out = stream(0)
    step = out.push([9], [-0.5], PLACES[:1])
    assert step.delta is None and step.finish == "length"
    assert out.completion_tokens == 0 and out.finish_reason == "length"


def test_alternatives_follow_their_visible_tokens_and_stop_at_eos() -> None:
    out = stream(8)
    first = out.push([7], [-0.1], PLACES[:1]).delta
    assert first is not None and first.top_logprobs == PLACES[:1]
    last = out.push([3, EOS], [-0.2, -0.4], (PLACES[1], PLACES[0])).delta
    assert last is not None and last.token_ids == (3,)
    assert last.logprobs == (-0.2,) and last.top_logprobs == (PLACES[1],)
    assert stream(4).push([7], [-0.1]).delta.top_logprobs == ()  # type: ignore[union-attr]


def test_admission_refuses_max_tokens_zero_unless_scoring_and_too_many_alternatives() -> None:
    assert check_request(request(max_tokens=0, prompt_logprobs=True), LIMITS) is None
    refused = check_request(request(max_tokens=0), LIMITS)
    assert refused is not None and "max_tokens" in str(refused)
    assert check_request(request(top_logprobs=TOP_LOGPROBS), LIMITS) is None
    refused = check_request(request(top_logprobs=TOP_LOGPROBS + 1), LIMITS)
    assert refused is not None and "top_logprobs" in str(refused)
    # the scored prompt's one scheduled token must fit the context too
    full = request(prompt_token_ids=(5,) * 64, max_tokens=0, prompt_logprobs=True)
    assert check_request(full, LIMITS) is not None
