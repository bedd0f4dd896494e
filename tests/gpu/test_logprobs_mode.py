"""``--logprobs-mode``: raw logprobs (the model's log-softmax) or processed logprobs (the
log of the distribution each token is drawn from), against a plain-Python reference.

The processed reference, token by token: logit processing (``logit_reference``), then
the temperature (1 for greedy rows), then the top-k, top-p and min-p filters, then a
log-softmax over the tokens they keep; every other token is ``-inf``. ``sample()`` and a
decode program built with ``ExecutionOptions(processed_logprobs=True)`` report exactly
that; raw mode reports the unprocessed, unfiltered log-softmax as before.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from logit_reference import reference_logits
from model_fixtures import CATALOG, DECODE, PAGE_SIZE, PREFILL_64, build_engine, prompt_of
from test_logit_processing import state_with

from gpu.engine import ModelEngine
from gpu.frames import SamplingParams, result_of
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions
from gpu.sampling import sample
from gpu.speculative import filtered_probs_by_lane, processed_log_probs_by_lane

VOCAB = 12
TOLERANCE = 1e-5


def reference_processed(logits: list[float], s: SamplingParams, *, prompt: list[int],
                        outputs: list[int], ends: set[int]) -> list[float]:
    """The processed logprobs of one row, in plain Python (vLLM's
    ``processed_logprobs``: the sampler's own distribution)."""
    x = reference_logits(logits, s, prompt=prompt, outputs=outputs, ends=ends)
    t = s.temperature if s.temperature > 0 else 1.0
    x = [v / t for v in x]
    top = max(x)
    z = sum(math.exp(v - top) for v in x)
    p = [math.exp(v - top) / z for v in x]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    k = s.top_k if s.top_k > 0 else len(x)
    in_k = order[:k]
    zk = sum(p[i] for i in in_k)
    kept, mass = set(), 0.0
    for rank, i in enumerate(in_k):
        if rank == 0 or mass < s.top_p:
            kept.add(i)
        mass += p[i] / zk
    kept = {i for i in kept if i == order[0] or p[i] >= s.min_p * p[order[0]]}
    zkept = sum(math.exp(x[i] - top) for i in kept)
    return [x[i] - top - math.log(zkept) if i in kept else -math.inf for i in range(len(x))]


CASES = [
    SamplingParams(temperature=0.7, top_k=4, seed=1),
    SamplingParams(temperature=1.3, top_p=0.6, seed=2),
    SamplingParams(temperature=1.0, min_p=0.2, seed=3),
    SamplingParams(temperature=0.0, top_k=3, seed=4),  # greedy: temperature 1, filtered
    SamplingParams(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.4, logit_bias=((5, 2.0),),
                   seed=5),
    SamplingParams(temperature=1.0, seed=6),  # nothing filtered: the raw distribution
]


def _sample_cases(logits: torch.Tensor, *, processed: bool, greedy_only: bool = False,
                  cases: list[SamplingParams] = CASES):
    prompt, outputs, ends = [1, 4, 4, 9], [4, 6, 6, 2], {2, 11}
    state = state_with([(s, prompt, outputs, ends) for s in cases], device_path=False)
    rows = torch.arange(len(cases))
    out = sample(
        logits, temperature=state.temperature[rows], top_p=state.top_p[rows],
        top_k=state.top_k[rows], seed=state.seed[rows],
        position=torch.full((len(cases),), 9, dtype=torch.int64), greedy_only=greedy_only,
        top_width=VOCAB, processing=state.processing(rows), processed_logprobs=processed)
    expected = [reference_processed(logits[i].tolist(), s, prompt=prompt, outputs=outputs,
                                    ends=ends) for i, s in enumerate(cases)]
    return out, expected


def assert_row(top_ids: list[int], top_lps: list[float], expected: list[float]) -> None:
    for token, lp in zip(top_ids, top_lps, strict=True):
        if expected[token] == -math.inf:
            assert lp == -math.inf, token
        else:
            assert lp == pytest.approx(expected[token], abs=TOLERANCE), token
    kept = [lp for lp in top_lps if lp > -math.inf]
    assert len(kept) == sum(e > -math.inf for e in expected)
    assert sum(math.exp(lp) for lp in kept) == pytest.approx(1.0, abs=1e-5)


def test_processed_logprobs_are_the_sampled_distribution() -> None:
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    out, expected = _sample_cases(logits, processed=True)
    for i in range(len(CASES)):
        assert_row(out.top_ids[i].tolist(), out.top_logprobs[i].tolist(), expected[i])
        token = int(out.token[i])
        assert expected[i][token] > -math.inf  # the drawn token is one the filters keep
        assert float(out.logprob[i]) == pytest.approx(expected[i][token], abs=TOLERANCE)
    # the filters cut where they should: top_k 4 keeps four, greedy top_k 3 keeps three
    assert sum(e > -math.inf for e in expected[0]) == 4
    assert sum(e > -math.inf for e in expected[3]) == 3
    assert all(e > -math.inf for e in expected[5])


def test_the_mode_changes_only_what_is_reported() -> None:
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(8)) * 3
    processed, _ = _sample_cases(logits, processed=True)
    raw, _ = _sample_cases(logits, processed=False)
    assert torch.equal(processed.token, raw.token)
    # raw: the unprocessed, unfiltered temperature-1 log-softmax
    want = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(raw.logprob, want.gather(1, raw.token[:, None]).squeeze(1))
    assert torch.allclose(raw.top_logprobs, want.sort(dim=-1, descending=True).values)
    assert not torch.allclose(processed.logprob, raw.logprob)


def test_the_greedy_shortcut_reports_the_same_processed_values() -> None:
    greedy = [replace(s, temperature=0.0) for s in CASES]
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    short, expected = _sample_cases(logits, processed=True, greedy_only=True, cases=greedy)
    full, _ = _sample_cases(logits, processed=True, cases=greedy)
    assert torch.equal(short.token, full.token)
    assert torch.equal(short.top_logprobs, full.top_logprobs)
    for i in range(len(CASES)):
        assert_row(short.top_ids[i].tolist(), short.top_logprobs[i].tolist(), expected[i])


def _decode_report(engine: ModelEngine, sampling: SamplingParams
                   ) -> tuple[torch.Tensor, list[tuple[int, float, list[tuple[int, float]]]]]:
    """Two decode steps of two rows; the last step's logits and its samples."""
    driver = ReferenceDriver(engine)
    for row in (0, 1):
        driver.prefill(PREFILL_64, row, prompt_of(13 + 5 * row, seed=row), chunk=64,
                       sampling=sampling)
    driver.decode(DECODE[2], [0, 1])
    driver.decode(DECODE[2], [0, 1])
    program = engine.programs[DECODE[2]]
    result = result_of(program.read_outputs())
    return program.lane_logits.clone(), [
        (s.token, s.logprob, list(s.top_logprobs)) for s in result.samples]


@pytest.mark.parametrize("execution", [ExecutionOptions.eager(processed_logprobs=True),
                                       ExecutionOptions.static(processed_logprobs=True)],
                         ids=["eager", "static"])
def test_a_decode_program_reports_processed_logprobs(
        tiny_checkpoints: dict[str, Path], execution: ExecutionOptions) -> None:
    sampling = SamplingParams(temperature=0.8, top_k=5, seed=11)
    engine = ModelEngine.load(tiny_checkpoints["llama"], device="cpu", dtype=None,
                              catalog=CATALOG, page_size=PAGE_SIZE, num_pages=64,
                              state_rows=8, execution=execution)
    logits, samples = _decode_report(engine, sampling)
    for lane, (token, logprob, top) in enumerate(samples):
        expected = reference_processed(logits[lane].tolist(), sampling, prompt=[], outputs=[],
                                       ends=set())
        assert logprob == pytest.approx(expected[token], abs=1e-4)
        finite = [(i, lp) for i, lp in top if lp > -math.inf]
        assert len(finite) == 5 and len(top) > 5
        for i, lp in finite:
            assert lp == pytest.approx(expected[i], abs=1e-4)
        assert sum(math.exp(lp) for _, lp in finite) == pytest.approx(1.0, abs=1e-4)


def test_a_raw_decode_program_is_unchanged(tiny_checkpoints: dict[str, Path]) -> None:
    sampling = SamplingParams(temperature=0.8, top_k=5, seed=11)
    logits, samples = _decode_report(build_engine(tiny_checkpoints["llama"]), sampling)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for lane, (token, logprob, top) in enumerate(samples):
        assert logprob == pytest.approx(float(raw[lane, token]), abs=1e-5)
        assert all(lp > -math.inf for _, lp in top)
        assert [i for i, _ in top] == raw[lane].topk(len(top)).indices.tolist()


def test_speculative_rows_report_the_log_of_the_verification_distribution() -> None:
    """Sampled rows of a speculative round: ``processed_log_probs_by_lane`` is the log of
    ``filtered_probs_by_lane`` (what rejection sampling draws from); greedy rows are
    their temperature-1 filtered distribution, not verification's one-hot."""
    logits = torch.randn(3, 4, VOCAB, generator=torch.Generator().manual_seed(10)) * 3
    params = {"temperature": torch.tensor([0.7, 1.4, 0.0]), "top_p": torch.tensor([0.8, 1.0, 1.0]),
              "top_k": torch.tensor([0, 5, 3]), "min_p": torch.tensor([0.0, 0.1, 0.0])}
    log_probs = processed_log_probs_by_lane(logits, **params)
    probs = filtered_probs_by_lane(logits, **params)
    assert torch.allclose(log_probs[:2].exp(), probs[:2], atol=1e-6)
    greedy = SamplingParams(temperature=0.0, top_k=3)
    for w in range(4):
        expected = reference_processed(logits[2, w].tolist(), greedy, prompt=[], outputs=[],
                                       ends=set())
        assert_row(list(range(VOCAB)), log_probs[2, w].tolist(), expected)
