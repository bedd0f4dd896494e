"""``RuntimeConfig.logprobs_mode`` through the runtime on the CPU backend with a tiny
random Llama.

Under ``processed_logprobs`` a filtered request's logprobs are those of the distribution
its tokens are drawn from: greedy requests (temperature 1, as in vLLM) with top-k and
top-p report transformers' log-softmax renormalised over the kept tokens, the filtered
alternatives ``-inf``; speculative loads (learned draft and copy proposals) report what
the plain load reports; scored prompt tokens stay raw (no sampler draws them).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio

from actors.config import RuntimeConfig
from actors.public import GenerationRequest, SamplingParams
from actors.system import open_runtime
from tests.actors.reference import hf_log_softmax
from tests.actors.test_runtime_cpu import config_for, prompt_of
from tests.actors.test_runtime_logprobs import (
    NEW_TOKENS,
    PROMPTS,
    SPECULATIVE_LOADS,
    Reported,
    assert_same_reports,
    reported,
    serve_greedy,
    speculative_config,
)

pytestmark = pytest.mark.slow

FILTERED = SamplingParams(temperature=0.0, top_k=4, top_p=0.9)
TOLERANCE = 1e-4
TOP = 6


def filtered_request(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=NEW_TOKENS,
                             sampling=FILTERED, ignore_eos=True, logprobs=True,
                             top_logprobs=TOP)


async def serve_filtered(config: RuntimeConfig) -> tuple[list[Reported], int]:
    return await serve_greedy(config, filtered_request)


def processed_reference(row: list[float]) -> dict[int, float]:
    """``FILTERED``'s kept tokens of one place and their renormalised logprobs."""
    order = sorted(range(len(row)), key=lambda i: -row[i])[:FILTERED.top_k]
    kept, mass = [], 0.0
    z = sum(math.exp(row[i]) for i in order)
    for i in order:
        if mass < FILTERED.top_p or not kept:
            kept.append(i)
        mass += math.exp(row[i]) / z
    log_z = math.log(sum(math.exp(row[i]) for i in kept))
    return {i: row[i] - log_z for i in kept}


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> list[Reported]:
    results, _ = trio.run(serve_filtered, config_for(tiny_llama,
                                                     logprobs_mode="processed_logprobs"))
    return results


def test_processed_logprobs_are_renormalised_over_the_kept_tokens(
        tiny_llama: Path, plain: list[Reported]) -> None:
    filtered_places = 0
    for prompt, out in zip(PROMPTS, plain, strict=True):
        assert len(out.tokens) == len(out.top) == NEW_TOKENS
        reference = hf_log_softmax(tiny_llama, prompt + out.tokens)
        for i, (token, logprob, top) in enumerate(zip(out.tokens, out.logprobs, out.top,
                                                      strict=True)):
            kept = processed_reference(reference[len(prompt) - 1 + i])
            assert len(top) == TOP and top[0][0] == token
            assert logprob == pytest.approx(kept[token], abs=TOLERANCE)
            finite = [(t, lp) for t, lp in top if lp > -math.inf]
            assert [t for t, _ in finite] == list(kept)
            assert [lp for _, lp in finite] == pytest.approx(list(kept.values()), abs=TOLERANCE)
            assert sum(math.exp(lp) for _, lp in finite) == pytest.approx(1.0, abs=1e-4)
            assert all(lp == -math.inf for _, lp in top[len(finite):])
            filtered_places += len(finite) < TOP
    assert filtered_places == len(PROMPTS) * NEW_TOKENS  # top_k 4 < 6 alternatives


@pytest.mark.parametrize(("mode", "source"), SPECULATIVE_LOADS)
def test_speculative_loads_report_the_plain_processed_values(
        tiny_llama: Path, tiny_draft: Path, plain: list[Reported], mode: str,
        source: str) -> None:
    config = speculative_config(tiny_llama, tiny_draft, mode, source,
                                logprobs_mode="processed_logprobs")
    results, speculative_frames = trio.run(serve_filtered, config)
    assert speculative_frames > 0
    assert_same_reports(results, plain)


async def test_scored_prompt_tokens_stay_raw(tiny_llama: Path) -> None:
    prompt = prompt_of(20, 6)
    with trio.fail_after(120):
        async with open_runtime(config_for(tiny_llama, logprobs_mode="processed_logprobs")
                                ) as rt:
            out = await reported(rt, GenerationRequest(
                prompt_token_ids=tuple(prompt), max_tokens=0, sampling=FILTERED,
                prompt_logprobs=True, logprobs=True, top_logprobs=TOP))
    assert out.scores is not None
    reference = hf_log_softmax(tiny_llama, prompt)
    for i in range(1, len(prompt)):
        logprob, top = out.scores.logprobs[i], out.scores.top_logprobs[i]
        assert logprob == pytest.approx(reference[i - 1][prompt[i]], abs=TOLERANCE)
        assert len(top) == TOP and all(lp > -math.inf for _, lp in top)
