"""Grammar token masks: packed bits, the sampling step's masking, and frames that carry
masks through a step program (structured output; OPEN-22 as decided in
docs/design/requirements.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import DECODE, PREFILL_64, build_engine, prompt_of

from gpu.frames import DecodeFrame, FrameError, SamplingParams
from gpu.grammar_mask import TokenMasks, allowed_tokens, mask_words
from gpu.programs.driver import ReferenceDriver
from gpu.sampling import sample


def _bits(allowed: set[int], vocab: int) -> bytes:
    words = np.zeros(mask_words(vocab), dtype=np.uint32)
    for token in allowed:
        words[token // 32] |= np.uint32(1) << np.uint32(token % 32)
    return words.view(np.int32).tobytes()


def test_mask_words_expand_to_exactly_the_allowed_tokens() -> None:
    vocab = 70  # a partial last word
    allowed = {0, 31, 32, 63, 69}
    words = torch.from_numpy(np.frombuffer(_bits(allowed, vocab), dtype=np.int32).copy())
    keep = allowed_tokens(words[None, :], vocab)[0]
    assert set(torch.nonzero(keep).flatten().tolist()) == allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1.7])
def test_sampling_never_picks_a_masked_token(temperature: float) -> None:
    """Masked logits get -inf before temperature and filtering: whatever the seed, a
    row samples only allowed tokens, its logprob is under the renormalised allowed
    distribution, and an unmasked row in the same batch is unaffected."""
    vocab, n = 100, 64
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=generator) * 4
    allowed = {5, 17, 40, 99}
    words = np.frombuffer(_bits(allowed, vocab), dtype=np.int32)
    mask = torch.from_numpy(np.stack([words] * (n - 1) + [np.full_like(words, -1)]))
    common = dict(temperature=torch.full((n,), temperature), top_p=torch.full((n,), 0.9),
                  top_k=torch.zeros(n, dtype=torch.int64),
                  seed=torch.arange(n, dtype=torch.int64),
                  position=torch.full((n,), 7, dtype=torch.int64))
    token, logprob, finite = sample(logits, token_mask=mask, **common)
    assert set(token[:-1].tolist()) <= allowed
    assert finite.all()
    index = torch.tensor(sorted(allowed))
    renormalised = torch.log_softmax(logits[:-1, index], dim=-1)
    position = [sorted(allowed).index(t) for t in token[:-1].tolist()]
    expected = renormalised[torch.arange(n - 1), torch.tensor(position)]
    assert torch.allclose(logprob[:-1], expected, atol=1e-5)
    free_token, free_logprob, _ = sample(logits, **common)
    assert token[-1] == free_token[-1] and logprob[-1] == free_logprob[-1]


def test_token_masks_stage_checks_rows_and_sizes() -> None:
    masks = TokenMasks(4, 70, device="cpu", always_apply=False)
    assert masks.stage((1, 2), ()) is None
    with pytest.raises(FrameError, match="not in the frame"):
        masks.stage((1, 2), ((3, _bits({1}, 70)),))
    with pytest.raises(FrameError, match="bytes"):
        masks.stage((1, 2), ((2, b"\0" * 4),))
    block = masks.stage((1, 2), ((2, _bits({1}, 70)),))
    assert block is not None and (block[0] == -1).all() and block[1, 0] == 2
    masks.upload(block)
    assert masks.current is not None
    masks.upload(None)
    assert masks.current is None  # an unconstrained frame skips masking


def test_static_masks_apply_every_execution_and_reset_to_all_allowed() -> None:
    """Capturable execution always reads the block: a frame without constrained lanes
    leaves it all-allowed, never the previous frame's masks."""
    masks = TokenMasks(2, 64, device="cpu", always_apply=True)
    masks.upload(masks.stage((0, 1), ((0, _bits({3}, 64)),)))
    masks.upload(None)
    current = masks.current
    assert current is not None and (current == -1).all()


def test_a_decode_frame_samples_only_its_lanes_allowed_tokens(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """Two sampled rows share a decode frame; only row 1 is constrained, over several
    steps with a different allowed set each step."""
    driver = ReferenceDriver(build_engine(tiny_checkpoints["llama"]))
    vocab = driver.engine.parts.decoder.config.vocab_size
    for row in (0, 1):
        driver.prefill(PREFILL_64, row, prompt_of(9, seed=row), chunk=64,
                       sampling=SamplingParams(temperature=1.5, seed=10 + row))
    for step in range(6):
        allowed = {3 + step, 40 + step, vocab - 1 - step}
        updates = ()
        for row in (0, 1):
            updates += driver.pages_for(row, driver.rows[row].position + 1)
            driver.rows[row].position += 1
        result = driver.run(DECODE[2], DecodeFrame(
            rows=(0, 1), updates=updates, token_masks=((1, _bits(allowed, vocab)),)))
        constrained = result.samples[1]
        assert constrained.row == 1 and constrained.token in allowed
