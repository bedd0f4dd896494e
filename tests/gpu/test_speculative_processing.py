"""Speculative rounds stay exact under logit processing: each target row is processed
with the penalty state as it would be after the lane's drafts before it
(``gpu.sampling.processing_after_drafts``), and the emitted tokens are counted into
the state inside the program. Greedy requests with each parameter produce exactly
the output of the same request without speculation, for learned drafts (a random one
and the target itself, whose drafts the processing then sometimes rejects) and copy
proposals, over wide, width-one and device-allocated rounds."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from model_fixtures import DECODE, EOS_ID, PREFILL_64, SNAPSHOT, build_draft_pair, prompt_of
from speculative_driver import SpeculativeDriver

from gpu.engine import ModelEngine
from gpu.frames import SamplingParams
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions
from gpu.programs.speculative_attach import attach_speculation
from gpu.programs.speculative_binding import COPY, LEARNED
from policy.descriptors import GraphKind, GraphShape, TargetBinding

GENERATE = 16
WIDE = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=4,
                  proposal_depth=3, packed_capacity=8, binding=TargetBinding.QUERY_LENGTH)
ONE = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=1,
                 proposal_depth=0, packed_capacity=2, binding=TargetBinding.QUERY_LENGTH)
DEVICE = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=3,
                    proposal_depth=2, packed_capacity=5,
                    binding=TargetBinding.SPECULATIVE_PREFIX_LIMIT)
SCHEDULE = [(WIDE, 4), (ONE, 1), (DEVICE, 3), (WIDE, 3), (None, 1)]
PROMPTS = (prompt_of(20, 1), prompt_of(8, 3) * 3)
GREEDY_WITH = {
    "logit_bias": SamplingParams(temperature=0.0, seed=1, logit_bias=((44, -3.0), (31, 1.5))),
    "presence": SamplingParams(temperature=0.0, seed=1, presence_penalty=0.4),
    "frequency": SamplingParams(temperature=0.0, seed=1, frequency_penalty=0.3),
    "repetition": SamplingParams(temperature=0.0, seed=1, repetition_penalty=1.3),
    # EOS (biased to win) is forbidden for the first three tokens: the first round
    # straddles the point where it becomes allowed
    "min_tokens": SamplingParams(temperature=0.0, seed=1, min_tokens=3,
                                 logit_bias=((EOS_ID, 30.0),)),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_draft_pair(tmp_path_factory.mktemp("spec_processing"))


def load(model: Path, execution: ExecutionOptions | None = None) -> ModelEngine:
    return ModelEngine.load(model, device="cpu", dtype=None,
                            catalog=(PREFILL_64, DECODE[1], DECODE[2], SNAPSHOT),
                            page_size=16, num_pages=64, state_rows=4, require_tokenizer=False,
                            execution=execution)


def prefill_all(driver: ReferenceDriver, sampling: SamplingParams) -> list[list[int]]:
    ends = (EOS_ID,) if sampling.min_tokens else ()
    return [[driver.prefill(PREFILL_64, row, prompt, chunk=64, sampling=sampling,
                            end_token_ids=ends)] for row, prompt in enumerate(PROMPTS)]


def without_speculation(target: Path, sampling: SamplingParams) -> list[list[int]]:
    driver = ReferenceDriver(load(target))
    outputs = prefill_all(driver, sampling)
    while len(outputs[0]) < GENERATE:
        for row, token in enumerate(driver.decode(DECODE[2], [0, 1])):
            outputs[row].append(token)
    return outputs


def with_speculation(target: Path, draft: Path | None, source: str, sampling: SamplingParams,
                     execution: ExecutionOptions | None = None
                     ) -> tuple[list[list[int]], int]:
    engine = load(target, execution)
    attach_speculation(engine, (WIDE, ONE, DEVICE), source=source, draft_model_dir=draft)
    driver = SpeculativeDriver(engine)
    outputs = prefill_all(driver, sampling)
    accepted = 0
    for shape, limit in itertools.cycle(SCHEDULE):
        if min(len(o) for o in outputs) >= GENERATE:
            break
        if shape is None:
            for row, token in enumerate(driver.decode(DECODE[2], [0, 1])):
                outputs[row].append(token)
            continue
        for lane in driver.speculate(shape, [0, 1], [limit, limit]).lanes:
            outputs[lane.row].extend(lane.tokens)
            accepted += lane.accepted
    state = engine.parts.state
    for row, tokens in enumerate(outputs):  # the program counted every emitted token
        assert int(state.generated[row]) == len(tokens)
        assert int(state.output_counts[row].sum()) == len(tokens)
    return [o[:GENERATE] for o in outputs], accepted


@pytest.mark.parametrize("name", sorted(GREEDY_WITH))
@pytest.mark.parametrize("source", ["learned", "self", COPY])
def test_greedy_speculation_with_processing_equals_no_speculation(
        pair: tuple[Path, Path], source: str, name: str) -> None:
    sampling = GREEDY_WITH[name]
    plain = without_speculation(pair[0], SamplingParams(temperature=0.0, seed=1))
    expected = without_speculation(pair[0], sampling)
    assert expected != plain  # the parameter matters for these prompts
    draft = {"learned": pair[1], "self": pair[0], COPY: None}[source]
    got, accepted = with_speculation(pair[0], draft, LEARNED if draft else COPY, sampling)
    assert got == expected
    if source == "self":
        assert accepted > 0  # drafts accepted: rows past the first are verified too


def test_static_execution_processes_every_round(pair: tuple[Path, Path]) -> None:
    """Under static options (what a captured graph runs: no host-known shortcuts) every
    round applies processing, with every parameter at once and sampled rows too."""
    for sampling in (
            SamplingParams(temperature=0.0, seed=1, repetition_penalty=1.2,
                           frequency_penalty=0.2, presence_penalty=0.2,
                           logit_bias=((31, 1.0),), min_tokens=3),
            SamplingParams(temperature=0.0, seed=1)):
        expected = without_speculation(pair[0], sampling)
        got, accepted = with_speculation(pair[0], pair[0], LEARNED, sampling,
                                         ExecutionOptions.static())
        assert got == expected and accepted > 0


MIXED_WIDE = GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=4,
                        proposal_depth=3, prefill_capacity=64, packed_capacity=64 + 4,
                        speculation_enabled=True)


def test_speculative_mixed_frames_process_the_prompt_lane_and_decode_lanes(
        pair: tuple[Path, Path]) -> None:
    """A prompt ending inside a wide speculative mixed frame samples its first token
    with processing and counts it; both requests then keep the output they have
    without speculation."""
    plain = without_speculation(pair[0], SamplingParams(temperature=0.0, seed=1))
    sampling = SamplingParams(temperature=0.0, seed=1, frequency_penalty=0.3,
                              presence_penalty=0.3, logit_bias=((plain[1][0], -100.0),))
    expected = without_speculation(pair[0], sampling)
    assert expected[1][0] != plain[1][0]
    engine = load(pair[0])
    attach_speculation(engine, (WIDE, MIXED_WIDE), source=LEARNED, draft_model_dir=pair[0])
    driver = SpeculativeDriver(engine)
    outputs = {0: [driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64, sampling=sampling)]}
    result = driver.speculate_mixed(MIXED_WIDE, [0, 1], [3, 0], prefill_row=1,
                                    prompt=PROMPTS[1], prompt_ends=True, sampling=sampling)
    assert result.prompt_sample is not None
    outputs[1] = [result.prompt_sample.token]
    outputs[0].extend(result.speculative.lanes[0].tokens)
    while min(len(o) for o in outputs.values()) < GENERATE:
        result = driver.speculate_mixed(MIXED_WIDE, [0, 1], [4, 4])
        for lane in result.speculative.lanes:
            outputs[lane.row].extend(lane.tokens)
    assert [outputs[row][:GENERATE] for row in (0, 1)] == expected
    state = engine.parts.state
    assert [int(state.generated[row]) for row in (0, 1)] == [len(outputs[0]), len(outputs[1])]
