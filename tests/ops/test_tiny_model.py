"""``ops.tiny_model``: the benchmarks' random checkpoints, written without transformers,
load in flare's loader and in transformers, and are a pure function of their spec."""

from __future__ import annotations

from pathlib import Path

import transformers as tf

from gpu.model.config import load_model_config
from ops.bench_speculation import TINY_DRAFT, TINY_TARGET
from ops.tiny_model import write_tiny_llama, write_tiny_pair


def test_tiny_pair_loads_in_flare_and_transformers(tmp_path: Path) -> None:
    target, draft = write_tiny_pair(TINY_TARGET, TINY_DRAFT, tmp_path)
    for directory, spec in ((target, TINY_TARGET), (draft, TINY_DRAFT)):
        config = load_model_config(directory)
        assert (config.vocab_size, config.hidden_size, config.num_layers) == (
            spec.shape.vocab_size, spec.shape.hidden_size, spec.shape.num_hidden_layers)
        assert config.eos_token_ids == (2,) and config.tie_word_embeddings
        _, info = tf.LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()


def test_same_spec_same_weights(tmp_path: Path) -> None:
    first = write_tiny_llama(TINY_DRAFT, tmp_path / "a")
    second = write_tiny_llama(TINY_DRAFT, tmp_path / "b")
    assert (first / "model.safetensors").read_bytes() == \
        (second / "model.safetensors").read_bytes()
