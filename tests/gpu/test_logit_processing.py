"""Logit processing (``gpu.sampling.process_logits``) and the min-p filter against a
plain-Python reference, with the per-row state a ``RowInit`` writes and programs
update (``RequestState.record_outputs``).

The reference follows vLLM's semantics token by token: bias added; tokens seen in the
prompt or the output have positive logits divided by (negative multiplied by) the
repetition penalty; ``frequency * count + presence * [count > 0]`` subtracted over
*output* counts; ending tokens forbidden while fewer than ``min_tokens`` were generated.
"""

from __future__ import annotations

import math

import pytest
import torch
from logit_reference import reference_logits

from gpu.frames import RowInit, SamplingParams
from gpu.model.kv_cache import CacheGeometry
from gpu.request_state import RequestState
from gpu.sampling import min_p_keep, process_logits, processing_after_drafts, sample

VOCAB = 12
FORBIDDEN_BELOW = -1e29


def state_with(rows: list[tuple[SamplingParams, list[int], list[int], set[int]]], *,
               device_path: bool) -> RequestState:
    """A state whose row ``i`` was initialised for ``rows[i]`` (sampling, prompt, outputs,
    ending ids) and then recorded its outputs one token per frame."""
    geometry = CacheGeometry(page_size=4, num_pages=4, max_context=16)
    state = RequestState(len(rows), geometry, vocab_size=VOCAB, device="cpu")
    if device_path:
        state.host_views = None  # the tensor-write path a device takes
    state.apply_updates(tuple(
        RowInit(row=i, sampling=s, prompt_tokens=tuple(prompt), end_token_ids=tuple(ends))
        for i, (s, prompt, _, ends) in enumerate(rows)))
    longest = max(len(r[2]) for r in rows)
    index = torch.arange(len(rows))
    for step in range(longest):
        tokens = torch.tensor([[r[2][step] if step < len(r[2]) else 0] for r in rows])
        emitted = torch.tensor([[step < len(r[2])] for r in rows])
        state.record_outputs(index, tokens, emitted)
    return state


CASES = [
    SamplingParams(seed=1, logit_bias=((3, 5.0), (7, -100.0))),
    SamplingParams(seed=1, presence_penalty=1.5),
    SamplingParams(seed=1, frequency_penalty=0.7),
    SamplingParams(seed=1, frequency_penalty=-2.0, presence_penalty=-0.5),
    SamplingParams(seed=1, repetition_penalty=1.8),
    SamplingParams(seed=1, repetition_penalty=0.6),
    SamplingParams(seed=1, min_tokens=4),
    SamplingParams(seed=1, min_tokens=2),
    SamplingParams(seed=1, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                   logit_bias=((5, 2.5),), min_tokens=5),
    SamplingParams(seed=1),
]


@pytest.mark.parametrize("device_path", [False, True], ids=["host_views", "tensor_writes"])
def test_process_logits_matches_the_reference(device_path: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(len(CASES), VOCAB, generator=generator) * 3
    prompt, outputs, ends = [1, 4, 4, 9], [4, 6, 6, 2], {2, 11}
    state = state_with([(s, prompt, outputs, ends) for s in CASES], device_path=device_path)
    got = process_logits(logits, state.processing(torch.arange(len(CASES))))
    for i, s in enumerate(CASES):
        want = reference_logits(logits[i].tolist(), s, prompt=prompt, outputs=outputs, ends=ends)
        for token, (g, w) in enumerate(zip(got[i].tolist(), want, strict=True)):
            if w == -math.inf:
                assert g < FORBIDDEN_BELOW, (s, token)
            else:
                assert g == pytest.approx(w, rel=1e-6, abs=1e-5), (s, token)
    assert torch.equal(got[-1], logits[-1])  # everything off: unchanged, bit for bit


def test_output_counts_and_generated_follow_record_outputs() -> None:
    """Counts are per output token, prompt excluded; ``generated`` counts emitted tokens."""
    s = SamplingParams(seed=1, frequency_penalty=1.0)
    state = state_with([(s, [1, 1, 3], [5, 5, 7], set()), (s, [2], [], set())],
                       device_path=False)
    assert state.output_counts[0].tolist() == [0, 0, 0, 0, 0, 2, 0, 1, 0, 0, 0, 0]
    assert state.output_counts[1].sum().item() == 0
    assert state.generated[:2].tolist() == [3, 0]
    assert state.prompt_seen[0].nonzero().flatten().tolist() == []  # repetition off
    # a new request in the row starts clean
    state.apply_updates((RowInit(row=0, sampling=SamplingParams(seed=2, presence_penalty=1.0)),))
    assert state.output_counts[0].sum().item() == 0 and state.generated[0].item() == 0


def test_min_p_keeps_tokens_above_a_fraction_of_the_best() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, -5.0, 3.0]])
    min_p = torch.tensor([0.3, 0.0])
    keep = min_p_keep(logits, min_p)
    for row in range(2):
        probs = torch.softmax(logits[row].double(), dim=-1).tolist()
        want = [p >= min_p[row].item() * max(probs) for p in probs]
        assert keep[row].tolist() == want
    assert keep[0].tolist() == [True, True, False, False]  # e^-2 < 0.3 <= e^-1


def test_greedy_sampling_applies_processing_before_the_argmax() -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0, 3.9] + [-5.0] * (VOCAB - 4)])
    s = SamplingParams(seed=1, logit_bias=((1, -100.0),))
    state = state_with([(s, [], [], set())], device_path=False)
    rows = torch.arange(1)
    common = {"temperature": torch.zeros(1), "top_p": torch.ones(1),
              "top_k": torch.zeros(1, dtype=torch.int64), "seed": torch.zeros(1, dtype=torch.int64),
              "position": torch.ones(1, dtype=torch.int64)}
    plain, plain_lp, *_ = sample(logits, **common)
    for greedy_only in (False, True):
        token, logprob, *_ = sample(logits, **common, greedy_only=greedy_only,
                                   processing=state.processing(rows))
        assert (plain.item(), token.item()) == (1, 3)
        # the reported logprob is the model's own, before processing
        assert logprob.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 3].item())
    assert plain_lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_min_p_filter_changes_sampling_only_where_it_cuts() -> None:
    """At min_p 1 only the most likely token survives: every seed draws it."""
    logits = torch.tensor([[1.0, 1.2, 0.9, 1.1] + [0.5] * (VOCAB - 4)]).expand(64, -1)
    s = SamplingParams(seed=1, min_p=1.0)
    state = state_with([(s, [], [], set())], device_path=False)
    rows = torch.zeros(64, dtype=torch.int64)
    args = {"temperature": torch.ones(64), "top_p": torch.ones(64),
            "top_k": torch.zeros(64, dtype=torch.int64), "seed": torch.arange(64),
            "position": torch.ones(64, dtype=torch.int64)}
    token, *_ = sample(logits, **args, processing=state.processing(rows))
    assert set(token.tolist()) == {1}
    free, *_ = sample(logits, **args)
    assert len(set(free.tolist())) > 1


def test_processing_after_drafts_equals_the_state_after_emitting_them() -> None:
    """Target row ``i`` of a round sees the state the ordinary sampler would have after
    drafts ``0..i-1``: the same processed logits as recording them one by one."""
    s = SamplingParams(seed=1, frequency_penalty=0.9, presence_penalty=0.3,
                       repetition_penalty=1.4, min_tokens=3, logit_bias=((0, 1.0),))
    prompt, outputs, ends = [2, 3], [5], {8}
    drafts = [6, 6, 8]
    state = state_with([(s, prompt, outputs, ends)], device_path=False)
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=torch.Generator().manual_seed(5))
    per_row = processing_after_drafts(state.processing(torch.arange(1)),
                                      torch.tensor([drafts]))
    got = process_logits(logits, per_row)
    for i in range(len(drafts) + 1):
        sequential = state_with([(s, prompt, outputs + drafts[:i], ends)], device_path=False)
        want = process_logits(logits[i:i + 1], sequential.processing(torch.arange(1)))
        assert torch.equal(got[i:i + 1], want), i
    # an absent draft (negative) adds nothing
    absent = processing_after_drafts(state.processing(torch.arange(1)), torch.tensor([[-1]]))
    assert torch.equal(absent.counts[1], state.output_counts[0])


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0),
    ("repetition_penalty", math.inf), ("min_p", 1.5), ("min_p", math.nan), ("min_tokens", -1),
    ("logit_bias", ((3, 101.0),)), ("logit_bias", ((-1, 1.0),)),
    ("logit_bias", ((3, 1.0), (3, 2.0))), ("logit_bias", tuple((i, 1.0) for i in range(301))),
    ("stop_token_ids", (-4,)),
])
def test_out_of_range_processing_parameters_are_named(field: str, value: object) -> None:
    problem = SamplingParams(**{field: value}).problem()  # type: ignore[arg-type]
    assert problem is not None and field in problem


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    assert "logit_bias" in (SamplingParams(logit_bias=((12, 1.0),)).token_problem(12) or "")
    assert "stop_token_ids" in (SamplingParams(stop_token_ids=(12,)).token_problem(12) or "")
    assert SamplingParams(logit_bias=((11, 1.0),), stop_token_ids=(0,)).token_problem(12) is None
    geometry = CacheGeometry(page_size=4, num_pages=4, max_context=16)
    state = RequestState(2, geometry, vocab_size=VOCAB, device="cpu")
    with pytest.raises(ValueError, match="token ids"):
        state.apply_updates((RowInit(row=0, sampling=SamplingParams(
            seed=1, logit_bias=((VOCAB, 1.0),))),))
    with pytest.raises(ValueError, match="token ids"):
        state.apply_updates((RowInit(row=0, sampling=SamplingParams(seed=1, min_tokens=1),
                                     end_token_ids=(VOCAB,)),))
