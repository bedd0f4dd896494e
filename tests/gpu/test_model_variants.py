"""Rope scaling variants, sliding-window attention and the Gemma family against
transformers, on tiny random checkpoints the tests write (``variant_fixtures``: norm
weights and biases randomised).

Greedy continuations through the prepared programs equal transformers' greedy
``generate`` token for token (26 tokens: the prefill's first plus 25 decodes), for
every variant, and so do scored prompt log-probabilities (within 1e-4); the windowed
ones also through padded multi-lane decode, mixed frames,
static (full-row) execution and captured forwards, with prompt + output longer than
the window. The rope tables equal transformers' rotary embedding in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import CATALOG, DECODE, MIXED_4, PAGE_SIZE, PREFILL_64, HFReference, prompt_of
from variant_fixtures import VARIANTS, WINDOW, build_variant, scored_logprobs

from gpu.engine import ModelEngine
from gpu.model.config import load_model_config
from gpu.model.rope import rope_tables
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions

NEW_TOKENS = 26
WINDOWED = ("mistral", "qwen2_window", "qwen3_window", "gemma2")


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {kind: build_variant(kind, root / kind) for kind in VARIANTS}


@pytest.fixture(scope="module")
def reference(variants: dict[str, Path]) -> HFReference:
    return HFReference(variants)


def _engine(directory: Path, execution: ExecutionOptions | None = None) -> ModelEngine:
    return ModelEngine.load(directory, device="cpu", dtype=None, catalog=CATALOG,
                            page_size=PAGE_SIZE, num_pages=64, state_rows=8,
                            execution=execution)


def _prefill_then_decode(driver: ReferenceDriver, prompt: list[int], row: int = 0) -> list[int]:
    tokens = [driver.prefill(PREFILL_64, row, prompt, chunk=23)]
    while len(tokens) < NEW_TOKENS:
        tokens += driver.decode(DECODE[1], [row])
    return tokens


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_variant_greedy_equals_generate(kind: str, variants: dict[str, Path],
                                        reference: HFReference) -> None:
    """Chunked prefill (chunks of 23, so chunks start mid-page) then decode equals
    generate; the prompt is long enough that llama3/yarn scaling and windows apply."""
    prompt = prompt_of(70, seed=7)
    expected = reference.greedy(kind, prompt, NEW_TOKENS)
    assert _prefill_then_decode(ReferenceDriver(_engine(variants[kind])), prompt) == expected


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_variant_prompt_logprobs_equal_transformers(kind: str, variants: dict[str, Path],
                                                    reference: HFReference) -> None:
    """Scored prefill log-probabilities agree with transformers within 1e-4 (this also
    pins what greedy tokens cannot see, such as Gemma2's monotone logit soft-cap)."""
    prompt = prompt_of(64, seed=12)
    expected = reference.log_probs(kind, prompt)[torch.arange(63), torch.tensor(prompt[1:])]
    got = scored_logprobs(_engine(variants[kind]), prompt)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", WINDOWED)
def test_window_in_padded_decode_and_mixed_frames(kind: str, variants: dict[str, Path],
                                                  reference: HFReference) -> None:
    """Three requests decode on a padded B=4 program, then a fourth prompt joins
    through mixed frames: every stream equals generate."""
    prompts = [prompt_of(9 + 17 * i, seed=40 + i) for i in range(3)]
    late = prompt_of(60, seed=50)
    expected = [reference.greedy(kind, p, NEW_TOKENS) for p in prompts]
    expected_late = reference.greedy(kind, late, 3)
    driver = ReferenceDriver(_engine(variants[kind]))
    rows = (5, 2, 0)
    out = {row: [driver.prefill(PREFILL_64, row, p, chunk=64)] for row, p in zip(rows, prompts,
                                                                                 strict=True)}
    for _ in range(NEW_TOKENS - 5):
        for row, token in zip(rows, driver.decode(DECODE[4], rows), strict=True):
            out[row].append(token)
    out_late: list[int] = []
    for start, end in ((0, 40), (40, 60)):
        result = driver.mixed(MIXED_4, (*rows, 7), prefill_row=3, prompt=late[start:end],
                              prompt_start=start, prompt_ends=end == len(late))
        by_row = {s.row: s.token for s in result.samples}
        for row in rows:
            out[row].append(by_row[row])
        out_late += [by_row[7]] if 7 in by_row else []
    for _ in range(NEW_TOKENS - len(out[rows[0]])):
        for row, token in zip((*rows, 7), driver.decode(DECODE[4], (*rows, 7)), strict=True):
            (out[row] if row != 7 else out_late).append(token)
    assert [out[row] for row in rows] == expected
    assert out_late == expected_late  # its first token (mixed frame) and two decodes


@pytest.mark.parametrize("kind", ["mistral", "qwen2_window", "gemma", "gemma2"])
@pytest.mark.parametrize("execution", [ExecutionOptions.static(),
                                       ExecutionOptions.eager(capture_forward=True)],
                         ids=["static", "captured"])
def test_static_and_captured_forwards(execution: ExecutionOptions, kind: str,
                                      variants: dict[str, Path],
                                      reference: HFReference) -> None:
    """Full-row attention (static programs) and traced forwards honour windows
    (one per layer kind in Qwen2) and Gemma's scaled embeddings and norms."""
    prompt = prompt_of(45, seed=9)
    expected = reference.greedy(kind, prompt, NEW_TOKENS)
    driver = ReferenceDriver(_engine(variants[kind], execution))
    assert _prefill_then_decode(driver, prompt) == expected


def test_the_window_changes_the_output(variants: dict[str, Path], tmp_path: Path,
                                       reference: HFReference) -> None:
    """Without its window the Mistral checkpoint continues differently, so the
    equality tests above depend on the window being applied."""
    unwindowed = tmp_path / "unwindowed"
    unwindowed.mkdir()
    for path in variants["mistral"].iterdir():
        (unwindowed / path.name).write_bytes(path.read_bytes())
    config = json.loads((unwindowed / "config.json").read_text())
    config["sliding_window"] = None
    (unwindowed / "config.json").write_text(json.dumps(config))
    assert load_model_config(unwindowed).layer_windows == (None, None)
    assert load_model_config(variants["mistral"]).layer_windows == (WINDOW, WINDOW)
    prompt = prompt_of(45, seed=9)
    full = _prefill_then_decode(ReferenceDriver(_engine(unwindowed)), prompt)
    assert full != reference.greedy("mistral", prompt, NEW_TOKENS)


@pytest.mark.parametrize("kind", ["llama3", "linear", "dynamic", "yarn", "longrope"])
def test_rope_tables_equal_transformers(kind: str, variants: dict[str, Path]) -> None:
    """cos/sin of every position flare serves equal transformers' rotary embedding
    (attention factor included) within float32 rounding; dynamic NTK equals the plain
    tables within ``max_position_embeddings`` (it rescales only beyond)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(variants[kind], dtype="float32")
    config = load_model_config(variants[kind])
    length = config.max_context
    positions = torch.arange(length)[None]
    x = torch.zeros(1, length, config.head_dim)
    hf_cos, hf_sin = model.model.rotary_emb(x, positions)
    cos, sin = rope_tables(config.rope, config.head_dim, length, device="cpu",
                           dtype=torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)
    plain = rope_tables(type(config.rope)(theta=config.rope_theta), config.head_dim, length,
                        device="cpu", dtype=torch.float32)[0]
    assert torch.equal(cos, plain) == (kind == "dynamic")
