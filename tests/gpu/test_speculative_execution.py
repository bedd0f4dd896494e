"""Execution options of complete speculative programs: the eager CPU programs (attention
over only the context the round needs, per-lane attention for ragged rows, argmax
verification when every lane is greedy, no last draft step when no lane can accept
every draft) give the static, capturable programs' results.

Greedy and seeded-sampling lanes side by side, both proposal sources, rectangular and
ragged ``QueryLength``, rectangular and ragged ``SpeculativePrefixLimit``, width one,
wider speculative mixed frames and ordinary decode between rounds. Tokens, accepted and
verified counts, target rows, proposals and drafts are identical; logprobs, confidence
and survival agree to float32 rounding (attention sums fewer masked keys). The greedy
shortcut alone is exact bit for bit. Covers CAT-10 (one complete execution whatever
the options), SPEC-5, SPEC-18, SPEC-19, SPEC-22..24, ACC-10..12, ACC-27, MIX-15, MIX-43.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from model_fixtures import DECODE, PREFILL_64, build_checkpoint, prompt_of
from speculative_driver import SpeculativeDriver

from gpu.engine import ModelEngine
from gpu.frames import GREEDY, SamplingParams
from gpu.programs.execution import ExecutionOptions
from gpu.programs.speculative_attach import attach_speculation
from gpu.programs.speculative_binding import COPY, LEARNED
from gpu.programs.speculative_frames import SpeculativeResult
from policy.descriptors import GraphKind, GraphShape, TargetBinding

QL, PL = TargetBinding.QUERY_LENGTH, TargetBinding.SPECULATIVE_PREFIX_LIMIT
PAGE_SIZE = 16


def spec(b: int, w: int, p: int | None = None, binding: TargetBinding = QL) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=p or b * w, binding=binding)


RECT = spec(4, 4)
ONE = spec(4, 1)
RAGGED = spec(4, 4, 10)
RAGGED_DEVICE = spec(4, 4, 7, PL)
RECT_DEVICE = spec(2, 3, 6, PL)
MIXED_WIDE = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=4,
                        proposal_depth=3, prefill_capacity=64, packed_capacity=64 + 3 * 4,
                        speculation_enabled=True)
SHAPES = (RECT, ONE, RAGGED, RAGGED_DEVICE, RECT_DEVICE, MIXED_WIDE)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=21)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target and a smaller random draft with the same vocabulary."""
    import transformers as tf
    from model_fixtures import _common

    root = tmp_path_factory.mktemp("spec_execution")
    target = build_checkpoint("llama", root / "target")
    torch.manual_seed(5)
    config = tf.LlamaConfig(**_common(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      tie_word_embeddings=True))
    tf.LlamaForCausalLM(config).eval().save_pretrained(root / "draft")
    return target, root / "draft"


def _driver(pair: tuple[Path, Path], source: str, execution: ExecutionOptions
            ) -> SpeculativeDriver:
    engine = ModelEngine.load(pair[0], device="cpu", dtype=None,
                              catalog=(PREFILL_64, DECODE[4]), page_size=PAGE_SIZE,
                              num_pages=96, state_rows=6, require_tokenizer=False,
                              execution=execution)
    attach_speculation(engine, SHAPES, source=source,
                       draft_model_dir=pair[1] if source == LEARNED else None)
    return SpeculativeDriver(engine)


def _lanes(result: SpeculativeResult) -> list[dict[str, Any]]:
    return [{"row": lane.row, "tokens": lane.tokens, "accepted": lane.accepted,
             "evaluated": lane.evaluated, "target_rows": lane.target_rows,
             "proposed": lane.proposed, "drafts": lane.drafts, "finite": lane.finite,
             "logprobs": lane.logprobs, "survival": lane.survival,
             "top": lane.top_logprobs}
            for lane in result.lanes]


def _scenario(driver: SpeculativeDriver, sampled_rows: tuple[int, ...]
              ) -> tuple[list[list[dict[str, Any]]], list[np.ndarray], list[int]]:
    """Rounds of every shape over rows 0..3 (``sampled_rows`` sample, the rest are
    greedy); returns each round's lanes, its confidence sidecar and the context blocks
    the program gathered."""
    rounds: list[list[dict[str, Any]]] = []
    sidecars: list[np.ndarray] = []
    blocks: list[int] = []
    prompts = {0: prompt_of(20, 1), 1: prompt_of(8, 3) * 3, 2: prompt_of(31, 4),
               3: prompt_of(13, 2)}
    for row, prompt in prompts.items():
        driver.prefill(PREFILL_64, row, prompt, chunk=64,
                       sampling=SAMPLED if row in sampled_rows else GREEDY)
    programs = driver.engine.programs
    schedule: list[tuple[GraphShape, list[int], list[int]]] = [
        (RECT, [0, 1, 2, 3], [4, 4, 4, 4]),
        (RECT, [3, 1], [2, 3]),  # no lane reaches W: no last draft step
        (ONE, [0, 1, 2, 3], [1, 1, 1, 1]),
        (RAGGED, [2, 0, 3], [4, 2, 4]),
        (RAGGED_DEVICE, [0, 1, 2, 3], [4, 4, 3, 4]),
        (RECT_DEVICE, [1, 3], [3, 2]),
    ]
    for _ in range(3):
        for shape, rows, limits in schedule:
            result = driver.speculate(shape, rows, limits)
            rounds.append(_lanes(result))
            sidecars.append(result.confidence)
            blocks.append(programs[shape].context_blocks)  # type: ignore[attr-defined]
        driver.decode(DECODE[4], [0, 1, 2, 3])
        mixed = driver.speculate_mixed(MIXED_WIDE, [0, 1, 2], [4, 3, 2])
        rounds.append(_lanes(mixed.speculative))
        sidecars.append(mixed.speculative.confidence)
    return rounds, sidecars, blocks


def _assert_same(eager: tuple[Any, ...], static: tuple[Any, ...], *, exact: bool) -> None:
    exact_keys = ("row", "tokens", "accepted", "evaluated", "target_rows", "proposed",
                  "drafts", "finite")
    for eager_round, static_round in zip(eager[0], static[0], strict=True):
        for a, b in zip(eager_round, static_round, strict=True):
            assert {k: a[k] for k in exact_keys} == {k: b[k] for k in exact_keys}
            if exact:
                assert (a["logprobs"], a["survival"], a["top"]) == \
                    (b["logprobs"], b["survival"], b["top"])
            else:
                np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(a["survival"], b["survival"], rtol=1e-4, atol=1e-6)
                assert [[t for t, _ in alt] for alt in a["top"]] == \
                    [[t for t, _ in alt] for alt in b["top"]]
    for a, b in zip(eager[1], static[1], strict=True):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("source", [LEARNED, COPY])
def test_eager_speculative_programs_give_the_static_results(
    pair: tuple[Path, Path], source: str
) -> None:
    """CAT-10, SPEC-22..24, ACC-10..12, ACC-27: the eager programs read only the blocks
    covering their contexts, below the full row, and still produce the static programs' tokens,
    counts and drafts, with greedy and sampled lanes in the same rounds."""
    sampled = (1, 2)
    static = _scenario(_driver(pair, source, ExecutionOptions.static()), sampled)
    eager = _scenario(_driver(pair, source, ExecutionOptions.eager()), sampled)
    _assert_same(eager, static, exact=False)
    full = _driver(pair, source, ExecutionOptions.static()).engine.geometry.blocks_per_row
    assert set(static[2]) == {full}
    assert max(eager[2]) < full


@pytest.mark.parametrize("source", [LEARNED, COPY])
def test_the_greedy_shortcut_is_exact(pair: tuple[Path, Path], source: str) -> None:
    """Every lane greedy: verifying from argmax tokens (and drafting argmax tokens) gives
    the full rejection-sampling program's result bit for bit: tokens, logprobs, top
    alternatives, survival (ACC-27) and the confidence sidecar (ACC-10..12)."""
    shortcut = ExecutionOptions(greedy_shortcut=True)
    static = _scenario(_driver(pair, source, ExecutionOptions.static()), ())
    greedy = _scenario(_driver(pair, source, shortcut), ())
    _assert_same(greedy, static, exact=True)


def test_the_shortcut_follows_the_lanes_temperature(pair: tuple[Path, Path]) -> None:
    """The shortcut is chosen per frame from the active lanes only: one sampled lane
    turns it off, an idle row's temperature does not."""
    driver = _driver(pair, LEARNED, ExecutionOptions.eager())
    driver.prefill(PREFILL_64, 0, prompt_of(10, 1), chunk=64)
    driver.prefill(PREFILL_64, 1, prompt_of(10, 2), chunk=64, sampling=SAMPLED)
    program = driver.engine.programs[RECT]
    driver.speculate(RECT, [0], [4])
    assert program.any_sampled is False  # type: ignore[attr-defined]
    driver.speculate(RECT, [0, 1], [4, 4])
    assert program.any_sampled is True  # type: ignore[attr-defined]
    driver.speculate(RECT, [0], [2])
    assert program.any_sampled is False  # type: ignore[attr-defined]
    assert program.caches_last_draft is False  # type: ignore[attr-defined]
