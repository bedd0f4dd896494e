"""A tiny random Llama checkpoint for the runtime's CPU-backend tests, and its
transformers greedy reference. Built once per session with ``save_pretrained``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

TINY_VOCAB = 96
TINY_EOS = 2


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, TINY_VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import transformers as tf

    directory = tmp_path_factory.mktemp("actors_tiny_llama")
    torch.manual_seed(11)
    config = tf.LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, bos_token_id=1, eos_token_id=TINY_EOS, rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    tf.LlamaForCausalLM(config).eval().save_pretrained(directory)
    _write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: more intra-op threads only contend."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_draft(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random Llama with the target's vocabulary (a learned draft source)."""
    import shutil

    import torch
    import transformers as tf

    directory = tmp_path_factory.mktemp("actors_tiny_draft")
    torch.manual_seed(12)
    config = tf.LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        initializer_range=0.3, bos_token_id=1, eos_token_id=TINY_EOS, rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    tf.LlamaForCausalLM(config).eval().save_pretrained(directory)
    shutil.copy(tiny_llama / "tokenizer.json", directory / "tokenizer.json")
    return directory
