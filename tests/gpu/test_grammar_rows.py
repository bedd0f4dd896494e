"""Resident grammars (``gpu.grammar_rows``): per-row matchers held with the request
state, advanced by the step program with each sampled token, masking the next frame
without host feedback (flare's extension of QUEUE-13, docs/runtime.md *Structured
output*; OPEN-22 as decided in docs/design/requirements.md)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace

import llguidance
import numpy as np
import pytest
from model_fixtures import DECODE, PREFILL_64, build_engine

from gpu.engine import ModelEngine
from gpu.frames import (
    DecodeFrame,
    FrameError,
    PrefillFrame,
    RowInit,
    SamplingParams,
    StateUpdate,
)
from gpu.grammar_mask import ALL_ALLOWED
from gpu.grammar_rows import ResidentGrammars
from gpu.model.tokenizer import Tokenizer
from gpu.programs.driver import ReferenceDriver

MODEL = Path(__file__).resolve().parents[2] / "models" / "default"
PATTERN = "(ab|cd)+x"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(MODEL)


def _grammars(tokenizer: Tokenizer) -> ResidentGrammars:
    return ResidentGrammars(tokenizer.to_json(), vocab_size=tokenizer.vocab_size,
                            eos_token_ids=tokenizer.eos_token_ids)


def _host_matcher(tokenizer: Tokenizer, grammar: str) -> llguidance.LLMatcher:
    return llguidance.LLMatcher(llguidance.LLTokenizer(
        tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
        eos_token=list(tokenizer.eos_token_ids)), grammar, log_level=0)


def _allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_masks_follow_the_tokens_the_row_sampled(tokenizer: Tokenizer) -> None:
    """Lane 1's mask is what a fresh host matcher allows after the same tokens; lane 0
    (no grammar listed) allows everything; a complete grammar allows only EOS."""
    grammars = _grammars(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_regex(PATTERN)
    grammars.init_row(RowInit(row=5, grammar=grammar))
    host = _host_matcher(tokenizer, grammar)
    for token in tokenizer.encode("abcdx", add_special_tokens=False):
        block = grammars.mask_block(2, ((1, 5),))
        assert (block[0] == ALL_ALLOWED).all()
        expected = np.zeros(grammars.words, dtype=np.int32)
        host.unsafe_compute_mask_ptr(expected.ctypes.data, expected.nbytes)
        assert (block[1] == expected).all() and token in _allowed(block[1])
        assert host.consume_token(token)
        grammars.advance((5,), (token,))
    final = grammars.mask_block(1, ((0, 5),))
    assert _allowed(final[0]) == set(tokenizer.eos_token_ids)


def test_a_refused_token_leaves_the_lane_unmasked_and_a_new_row_resets(
    tokenizer: Tokenizer,
) -> None:
    """A matcher in error (a token the host also refuses and fails the lane for)
    masks nothing; ``RowInit`` without a grammar drops the row's matcher."""
    grammars = _grammars(tokenizer)
    grammars.init_row(RowInit(row=1, grammar=llguidance.LLMatcher.grammar_from_regex("a+")))
    grammars.advance((1,), tokenizer.encode("z", add_special_tokens=False)[:1])
    assert (grammars.mask_block(1, ((0, 1),)) == ALL_ALLOWED).all()
    grammars.init_row(RowInit(row=1))
    assert not grammars.holds(1)
    with pytest.raises(FrameError, match="holds no grammar"):
        grammars.mask_block(1, ((0, 1),))


def test_only_the_vocabulary_is_pickled(tokenizer: Tokenizer) -> None:
    """The device process receives the state once: the copy has no matchers yet and
    builds its own from the next ``RowInit``."""
    grammars = _grammars(tokenizer)
    grammars.init_row(RowInit(row=0, grammar=llguidance.LLMatcher.grammar_from_regex("a")))
    copy = pickle.loads(pickle.dumps(grammars))
    assert not copy.holds(0) and copy.words == grammars.words
    copy.init_row(RowInit(row=0, grammar=llguidance.LLMatcher.grammar_from_regex("a")))
    assert copy.holds(0)


@pytest.fixture(scope="module")
def engine() -> ModelEngine:
    engine = build_engine(MODEL)
    assert engine.hold_grammars(SimpleNamespace(resident_grammars=True))
    return engine


def test_step_programs_mask_resident_rows_frame_after_frame(
    engine: ModelEngine, tokenizer: Tokenizer,
) -> None:
    """A prefill then decode frames, each listing row 0 in ``grammar_rows`` and nothing
    else about its grammar: the program masks each sample with what the row's matcher
    allows after the tokens it sampled before, so a host matcher accepts every token
    in turn; row 1, unconstrained, decodes in the same frames."""
    driver = ReferenceDriver(engine)
    prompt = tuple(tokenizer.encode("Spell it:"))
    hot = SamplingParams(temperature=1.5, seed=7)
    grammar = llguidance.LLMatcher.grammar_from_regex(PATTERN)
    init = dataclasses.replace(driver.init_row(0, hot), grammar=grammar)
    first = driver.run(PREFILL_64, PrefillFrame(
        row=0, tokens=prompt, start_position=0, ends_prompt=True, grammar_rows=(0,),
        updates=(init, *driver.pages_for(0, len(prompt)))))
    driver.rows[0].position = len(prompt)
    driver.prefill(PREFILL_64, 1, prompt, chunk=64, sampling=hot)
    host = _host_matcher(tokenizer, grammar)
    token = first.samples[0].token
    free = []
    for _ in range(16):
        assert host.consume_token(token), token
        if host.is_stopped():
            break
        pages: tuple[StateUpdate, ...] = ()
        for row in (0, 1):
            pages += driver.pages_for(row, driver.rows[row].position + 1)
            driver.rows[row].position += 1
        result = driver.run(DECODE[2], DecodeFrame(rows=(0, 1), updates=pages,
                                                   grammar_rows=(0,)))
        token = result.samples[0].token
        free.append(result.samples[1].token)
    assert len(set(free)) > 1  # the free row was not masked to the pattern's tokens


def test_frames_name_resident_rows_only_where_the_programs_hold_them(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """Without resident grammars a frame listing ``grammar_rows`` fails to bind, and a
    ``RowInit`` carrying a grammar is refused; rows outside the frame are refused too."""
    driver = ReferenceDriver(build_engine(tiny_checkpoints["llama"]))
    driver.prefill(PREFILL_64, 0, (5, 6, 7), chunk=64)
    with pytest.raises(FrameError, match="holds no resident grammars"):
        driver.run(DECODE[1], DecodeFrame(rows=(0,), grammar_rows=(0,)))
    with pytest.raises(FrameError, match="hold no resident grammars"):
        driver.run(DECODE[1], DecodeFrame(rows=(0,), updates=(RowInit(row=0, grammar="x"),)))
