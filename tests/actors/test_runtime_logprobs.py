"""Reported logprobs through the runtime on the CPU backend with a tiny random Llama.

Each generated token's logprob and its top alternatives are transformers' log-softmax
(greedy requests), best first; a request keeps exactly the k alternatives it asked for
and none when it asked for none; a sampled token's logprob is its entry in the list when
it is there; speculative loads (learned draft and copy proposals) report what the plain
load reports; a scored prompt with ``max_tokens`` 0 reports its prompt and generates
nothing. A frame's program computes the most alternatives any of its rows asks for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from actors.config import RuntimeConfig
from actors.public import (
    TOP_LOGPROBS,
    Alternatives,
    Finished,
    GenerationRequest,
    PromptScores,
    Runtime,
    SamplingParams,
    TokenDelta,
)
from actors.system import open_runtime
from tests.actors.reference import hf_log_softmax
from tests.actors.test_runtime_cpu import config_for, prompt_of
from tests.actors.toy import wait_until_idle

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
TOLERANCE = 1e-4
NEW_TOKENS = 10


@dataclass
class Reported:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[Alternatives] = field(default_factory=list)
    scores: PromptScores | None = None
    finished: Finished | None = None


async def reported(rt: Runtime, request: GenerationRequest) -> Reported:
    out = Reported()
    async with rt.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                out.tokens.extend(event.token_ids)
                out.logprobs.extend(event.logprobs)
                out.top.extend(event.top_logprobs)
            elif isinstance(event, PromptScores):
                out.scores = event
            elif isinstance(event, Finished):
                out.finished = event
    return out


def greedy_request(prompt: list[int], top: int) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=NEW_TOKENS,
                             sampling=GREEDY, ignore_eos=True, logprobs=True, top_logprobs=top)


def assert_best_first(top: Alternatives, k: int) -> None:
    assert len(top) == k
    values = [lp for _, lp in top]
    assert values == sorted(values, reverse=True)
    assert len({i for i, _ in top}) == k


def assert_matches_reference(reference: list[list[float]], place: int, token: int,
                             logprob: float, top: Alternatives) -> None:
    """``token`` at ``place`` (a row of ``reference``) with its logprob and alternatives."""
    row = reference[place]
    assert logprob == pytest.approx(row[token], abs=TOLERANCE)
    best = sorted(range(len(row)), key=lambda i: -row[i])[:len(top)]
    assert [i for i, _ in top] == best
    assert [lp for _, lp in top] == pytest.approx([row[i] for i in best], abs=TOLERANCE)


PROMPTS = [prompt_of(9, 1), prompt_of(37, 2), [5, 6, 7, 8, 9] * 6]


def greedy_top_5(prompt: list[int]) -> GenerationRequest:
    return greedy_request(prompt, 5)


async def serve_greedy(config: RuntimeConfig,
                       request_for: Callable[[list[int]], GenerationRequest] = greedy_top_5
                       ) -> tuple[list[Reported], int]:
    """The reports of one request per prompt (greedy, 5 alternatives, unless
    ``request_for`` says otherwise), served together, and the speculative frames run."""
    results: list[Reported] = [Reported() for _ in PROMPTS]
    with trio.fail_after(240):
        async with open_runtime(config) as rt:

            async def one(i: int) -> None:
                results[i] = await reported(rt, request_for(PROMPTS[i]))

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
            await wait_until_idle(rt)
            return results, rt.statistics().speculative_frames


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> list[Reported]:
    """The greedy requests' reports without speculation (run once per module)."""
    results, _ = trio.run(serve_greedy, config_for(tiny_llama))
    return results


def test_greedy_logprobs_and_alternatives_equal_transformers(
        tiny_llama: Path, plain: list[Reported]) -> None:
    for prompt, out in zip(PROMPTS, plain, strict=True):
        assert len(out.tokens) == len(out.logprobs) == len(out.top) == NEW_TOKENS
        reference = hf_log_softmax(tiny_llama, prompt + out.tokens)
        for i, (token, logprob, top) in enumerate(zip(out.tokens, out.logprobs, out.top,
                                                      strict=True)):
            assert_best_first(top, 5)
            assert top[0][0] == token  # greedy: the sampled token is the best
            assert top[0][1] == pytest.approx(logprob, abs=1e-6)
            assert_matches_reference(reference, len(prompt) - 1 + i, token, logprob, top)


async def test_k_alternatives_none_for_zero_and_sampled_tokens_in_their_list(
        tiny_llama: Path) -> None:
    prompt = prompt_of(20, 4)
    with trio.fail_after(120):
        async with open_runtime(config_for(tiny_llama)) as rt:
            none = await reported(rt, greedy_request(prompt, 0))
            widest = await reported(rt, GenerationRequest(
                prompt_token_ids=tuple(prompt), max_tokens=NEW_TOKENS, ignore_eos=True,
                sampling=SamplingParams(temperature=1.5, seed=3), logprobs=True,
                top_logprobs=TOP_LOGPROBS))
    assert len(none.logprobs) == NEW_TOKENS and none.top == []
    assert len(widest.top) == NEW_TOKENS
    reference = hf_log_softmax(tiny_llama, prompt + widest.tokens)
    hits = 0
    for i, (token, logprob, top) in enumerate(zip(widest.tokens, widest.logprobs, widest.top,
                                                  strict=True)):
        assert_best_first(top, TOP_LOGPROBS)
        # raw distribution: the temperature does not change the reported values
        assert_matches_reference(reference, len(prompt) - 1 + i, token, logprob, top)
        listed = dict(top)
        if token in listed:
            hits += 1
            assert listed[token] == pytest.approx(logprob, abs=1e-6)
        else:
            assert logprob <= top[-1][1] + 1e-6
    assert hits > 0


SPECULATIVE_LOADS = [("fixed", "draft"), ("adaptive", "copy")]


def speculative_config(tiny_llama: Path, tiny_draft: Path, mode: str, source: str,
                       **kw: object) -> RuntimeConfig:
    """A depth-3 speculative load: a learned draft or copy proposals."""
    return config_for(tiny_llama, speculation=mode, draft_source=source,
                      draft_model_dir=tiny_draft if source == "draft" else None,
                      draft_depth=3, **kw)


@pytest.mark.parametrize(("mode", "source"), SPECULATIVE_LOADS)
def test_speculative_loads_report_what_the_plain_load_reports(
        tiny_llama: Path, tiny_draft: Path, plain: list[Reported], mode: str,
        source: str) -> None:
    config = speculative_config(tiny_llama, tiny_draft, mode, source)
    results, speculative_frames = trio.run(serve_greedy, config)
    assert speculative_frames > 0
    assert_same_reports(results, plain)


def assert_same_reports(results: list[Reported], plain: list[Reported]) -> None:
    """The same tokens, logprobs and alternatives. Alternatives of probability zero
    (``-inf``, processed logprobs) tie, so only how many there are is compared."""
    for spec, base in zip(results, plain, strict=True):
        assert spec.tokens == base.tokens
        assert spec.logprobs == pytest.approx(base.logprobs, abs=TOLERANCE)
        for a, b in zip(spec.top, base.top, strict=True):
            real_a = [(i, lp) for i, lp in a if lp > float("-inf")]
            real_b = [(i, lp) for i, lp in b if lp > float("-inf")]
            assert len(a) == len(b) and [i for i, _ in real_a] == [i for i, _ in real_b]
            assert [lp for _, lp in real_a] == pytest.approx([lp for _, lp in real_b],
                                                             abs=TOLERANCE)


async def test_scoring_with_max_tokens_zero_reports_the_prompt_and_generates_nothing(
        tiny_llama: Path) -> None:
    prompt = prompt_of(70, 6)  # two chunks of the 64-token scored prefill
    with trio.fail_after(120):
        async with open_runtime(config_for(tiny_llama)) as rt:
            out = await reported(rt, GenerationRequest(
                prompt_token_ids=tuple(prompt), max_tokens=0, sampling=GREEDY,
                prompt_logprobs=True, logprobs=True, top_logprobs=3))
    assert out.tokens == [] and out.finished is not None and out.scores is not None
    assert (out.finished.reason, out.finished.completion_tokens) == ("length", 0)
    assert out.scores.token_ids == tuple(prompt)
    assert out.scores.logprobs[0] is None and out.scores.top_logprobs[0] == ()
    reference = hf_log_softmax(tiny_llama, prompt)
    for i in range(1, len(prompt)):
        logprob, top = out.scores.logprobs[i], out.scores.top_logprobs[i]
        assert logprob is not None
        assert_best_first(top, 3)
        assert_matches_reference(reference, i - 1, prompt[i], logprob, top)
