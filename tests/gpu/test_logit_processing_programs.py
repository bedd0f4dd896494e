"""Logit processing inside the prepared programs: greedy output equals a transformers
reference with the same processing, under eager and static execution options, and the
penalty state advances inside the programs, so a decode frame queued behind another
(two frame slots, no host round trip) sees every token before it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from logit_reference import reference_greedy
from model_fixtures import CATALOG, DECODE, EOS_ID, MIXED_2, PAGE_SIZE, PREFILL_64, prompt_of

from gpu.engine import ModelEngine
from gpu.frames import DecodeFrame, SamplingParams, as_inputs
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions

NEW = 10
PROCESSED = {
    "logit_bias": SamplingParams(temperature=0.0, seed=1,
                                 logit_bias=((17, 9.0), (40, 6.0), (3, -100.0))),
    "presence": SamplingParams(temperature=0.0, seed=1, presence_penalty=2.0),
    "frequency": SamplingParams(temperature=0.0, seed=1, frequency_penalty=1.5),
    "repetition": SamplingParams(temperature=0.0, seed=1, repetition_penalty=1.6),
    "min_tokens": SamplingParams(temperature=0.0, seed=1, min_tokens=NEW,
                                 logit_bias=((EOS_ID, 30.0),)),
    "mixed": SamplingParams(temperature=0.0, seed=1, repetition_penalty=1.2,
                            frequency_penalty=0.5, presence_penalty=0.5,
                            logit_bias=((11, 2.0),)),
}


def engine_for(model_dir: Path, execution: ExecutionOptions | None) -> ModelEngine:
    return ModelEngine.load(model_dir, device="cpu", dtype=None, catalog=CATALOG,
                            page_size=PAGE_SIZE, num_pages=64, state_rows=8,
                            execution=execution)


def run_greedy(driver: ReferenceDriver, prompt: list[int], sampling: SamplingParams, *,
               row: int = 0, ends: tuple[int, ...] = ()) -> list[int]:
    tokens = [driver.prefill(PREFILL_64, row, prompt, chunk=64, sampling=sampling,
                             end_token_ids=ends)]
    for _ in range(NEW - 1):
        tokens += driver.decode(DECODE[1], [row])
    return tokens


@pytest.mark.parametrize("execution", [None, ExecutionOptions.static()], ids=["eager", "static"])
def test_greedy_output_with_processing_equals_the_reference(
        tiny_checkpoints: dict[str, Path], hf_reference: object, execution: object) -> None:
    model = hf_reference.model("llama")  # type: ignore[attr-defined]
    driver = ReferenceDriver(engine_for(tiny_checkpoints["llama"], execution))  # type: ignore[arg-type]
    prompt = prompt_of(20, 1)  # its greedy continuation repeats a token five times
    plain = run_greedy(driver, prompt, SamplingParams(temperature=0.0, seed=1))
    assert plain == reference_greedy(model, prompt, NEW, SamplingParams(temperature=0.0))
    assert len(set(plain)) <= NEW - 4
    for name, sampling in PROCESSED.items():
        ends = (EOS_ID,) if sampling.min_tokens else ()
        got = run_greedy(driver, prompt, sampling, ends=ends)
        assert got == reference_greedy(model, prompt, NEW, sampling, ends=set(ends)), name
        if name != "min_tokens":
            assert got != plain, name  # each parameter changes this output
    # min_tokens: the biased EOS is forbidden for NEW tokens (the plain output), where
    # the bias alone would pick it every time; from min_tokens on it wins at once
    assert run_greedy(driver, prompt, PROCESSED["min_tokens"], ends=(EOS_ID,)) == plain
    assert run_greedy(driver, prompt, SamplingParams(
        temperature=0.0, seed=1, logit_bias=((EOS_ID, 30.0),))) == [EOS_ID] * NEW
    assert run_greedy(driver, prompt, SamplingParams(
        temperature=0.0, seed=1, min_tokens=1, logit_bias=((EOS_ID, 30.0),)),
        ends=(EOS_ID,))[1] == EOS_ID


def test_penalty_state_advances_inside_queued_decode_frames(
        tiny_checkpoints: dict[str, Path]) -> None:
    """Two decode frames bound and executed back to back, with no output read between
    them, produce what one-at-a-time decoding does; the counts hold every output."""
    sampling = SamplingParams(temperature=0.8, seed=9, frequency_penalty=2.0,
                              presence_penalty=1.0, top_k=20)
    prompt = prompt_of(12, 7)
    one = ReferenceDriver(engine_for(tiny_checkpoints["llama"], None))
    expected = run_greedy(one, prompt, sampling)[:3]

    driver = ReferenceDriver(engine_for(tiny_checkpoints["llama"], None))
    engine = driver.engine
    first = driver.prefill(PREFILL_64, 2, prompt, chunk=64, sampling=sampling)
    program = engine.programs[DECODE[1]]
    frames = []
    for _ in range(2):
        updates = driver.pages_for(2, driver.rows[2].position + 1)
        driver.rows[2].position += 1
        frames.append(DecodeFrame(rows=(2,), updates=updates))
    tokens = []
    for frame in frames:
        program.bind(as_inputs(frame))
        program.execute()
    tokens = [first, int(engine.parts.state.pending_token[2])]
    assert tokens[-1] == expected[2] and first == expected[0]
    state = engine.parts.state
    counts = state.output_counts[2]
    assert int(state.generated[2]) == 3 and counts.sum().item() == 3
    assert counts[expected[0]].item() >= 1 and counts[expected[2]].item() >= 1
    assert sorted(torch.nonzero(counts).flatten().tolist()) == sorted(set(expected))


def test_mixed_frames_apply_and_record_processing(tiny_checkpoints: dict[str, Path],
                                                  hf_reference: object) -> None:
    """A decode lane of a mixed frame and its prompt lane's first token are processed
    and counted like in decode and prefill programs."""
    model = hf_reference.model("llama")  # type: ignore[attr-defined]
    driver = ReferenceDriver(engine_for(tiny_checkpoints["llama"], None))
    sampling = PROCESSED["mixed"]
    prompt_a, prompt_b = prompt_of(20, 4), prompt_of(9, 5)
    tokens_a = [driver.prefill(PREFILL_64, 0, prompt_a, chunk=64, sampling=sampling)]
    result = driver.mixed(MIXED_2, [0, 1], prefill_row=1, prompt=prompt_b, prompt_ends=True,
                          sampling=sampling)
    by_row = {s.row: s.token for s in result.samples}
    tokens_a.append(by_row[0])
    tokens_b = [by_row[1]]
    for _ in range(3):
        a, b = driver.decode(DECODE[2], [0, 1])
        tokens_a.append(a)
        tokens_b.append(b)
    assert tokens_a == reference_greedy(model, prompt_a, len(tokens_a), sampling)
    assert tokens_b == reference_greedy(model, prompt_b, len(tokens_b), sampling)
