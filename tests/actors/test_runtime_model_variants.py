"""Checkpoints beyond plain Llama served by the runtime on the CPU backend.

A Llama-3-style checkpoint (``rope_scaling`` of type llama3, grouped-query attention,
bf16 weights, the default model's tokenizer): ``dtype="auto"`` serves it in bf16
(weights as stored) and its greedy output equals transformers run in bf16 over the
first 8 tokens (the reduced-precision horizon stated in
``tests/gpu/test_model_dtypes.py``); ``dtype="float32"`` equals transformers in float32
token for token over 24 tokens. Text goes through the shipped tokenizer.

A Mistral checkpoint with a sliding window narrower than prompt + output, served with
fixed-depth speculative rounds (its own weights as the draft, so rounds accept and
verify several positions at once): greedy output equals transformers' (SPEC-5).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import structlog
import trio

from actors.config import DEFAULT_MODEL_DIR
from actors.system import open_runtime
from tests.actors.reference import hf_greedy
from tests.actors.test_runtime_cpu import config_for, generate, prompt_of

PROMPT = "Once upon a time there was a small robot who wanted to"


def _randomise_norms(model: object) -> None:
    """Norm weights away from transformers' initial 1 (so a misapplied norm shows)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            if "norm" in name:
                param.add_(torch.randn(param.shape) * 0.3)


@pytest.fixture(scope="module")
def llama3_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama-3-style checkpoint (vocabulary of the default tokenizer)."""
    import torch
    import transformers as tf

    directory = tmp_path_factory.mktemp("llama3_bf16")
    vocab = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"]
    torch.manual_seed(31)
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, initializer_range=0.3, bos_token_id=0, eos_token_id=0,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = tf.LlamaForCausalLM(config)
    _randomise_norms(model)
    model.to(torch.bfloat16).eval().save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    return directory


@pytest.mark.parametrize(("dtype", "new_tokens"), [("auto", 8), ("float32", 24)])
async def test_a_llama3_style_checkpoint_serves_and_matches_transformers(
        llama3_bf16: Path, dtype: str, new_tokens: int) -> None:
    from tokenizers import Tokenizer

    stored = json.loads((llama3_bf16 / "config.json").read_text())
    assert stored["dtype"] == "bfloat16" and stored["rope_parameters"]["rope_type"] == "llama3"
    prompt = Tokenizer.from_file(str(llama3_bf16 / "tokenizer.json")).encode(PROMPT).ids
    expected = hf_greedy(llama3_bf16, prompt, new_tokens,
                         dtype="bfloat16" if dtype == "auto" else dtype)
    with trio.fail_after(120), structlog.testing.capture_logs() as logs:
        async with open_runtime(config_for(llama3_bf16, dtype=dtype,
                                           capture_forward=False)) as runtime:
            tokens, _ = await generate(runtime, prompt, new_tokens)
    assert tokens == expected
    ready = [entry for entry in logs if entry["event"] == "runtime ready"]
    assert [entry["dtype"] for entry in ready] == ["bfloat16" if dtype == "auto" else dtype]


@pytest.fixture(scope="module")
def mistral_windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mistral with a 13-token sliding window (randomised norms)."""
    import torch
    import transformers as tf

    from tests.actors.conftest import TINY_EOS, TINY_VOCAB, _write_tokenizer

    directory = tmp_path_factory.mktemp("mistral_windowed")
    torch.manual_seed(32)
    config = tf.MistralConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, sliding_window=13, max_position_embeddings=256,
                              initializer_range=0.3, bos_token_id=1, eos_token_id=TINY_EOS,
                              tie_word_embeddings=True)
    model = tf.MistralForCausalLM(config)
    _randomise_norms(model)
    model.eval().save_pretrained(directory)
    _write_tokenizer(directory)
    return directory


@pytest.mark.slow
async def test_a_windowed_mistral_keeps_greedy_output_through_speculative_rounds(
        mistral_windowed: Path) -> None:
    prompt = prompt_of(30, seed=4)
    expected = hf_greedy(mistral_windowed, prompt, 24)
    config = config_for(mistral_windowed, speculation="adaptive", draft_source="draft",
                        draft_model_dir=mistral_windowed, draft_depth=3,
                        scheduler_policy="fixed-spec-3", capture_forward=False)
    with trio.fail_after(120):
        async with open_runtime(config) as runtime:
            tokens, _ = await generate(runtime, prompt, 24)
            graphs = dict(runtime.statistics().executions_by_graph)
    assert tokens == expected
    assert any(label.startswith("speculative[") for label in graphs), graphs
