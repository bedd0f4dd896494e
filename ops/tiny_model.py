"""Random tiny Llama checkpoints for the benchmarks' ``--tiny`` runs.

Written with torch and safetensors alone (the training recipe's plain-torch Llama and its
``config.json``), so shipped commands need nothing beyond the runtime's own dependencies.
Every model gets a word-level tokenizer over its whole vocabulary: ``<unk>`` 0, ``<s>`` 1,
``</s>`` 2 (end of sequence), then ``w3``, ``w4``, ... A model is a pure function of its
shape, seed and initial spread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from ops.training.export import llama_config
from ops.training.llama import LlamaForCausalLM, LlamaShape

BOS_ID = 1
EOS_ID = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyLlama:
    """One random model: its shape, the seed of its weights and their spread."""

    shape: LlamaShape
    seed: int
    init_std: float = 0.02
    """Standard deviation of every projection and embedding weight (norms start at one)."""


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Whitespace-split words ``w3``..``w{vocab_size - 1}`` plus the three specials."""
    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def write_tiny_llama(spec: TinyLlama, directory: Path) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files of ``spec``
    into ``directory``; returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    model = LlamaForCausalLM(spec.shape)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, spec.init_std, generator=generator)
    config = llama_config(model, bos_id=BOS_ID, eos_id=EOS_ID)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(model.checkpoint_tensors(), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    word_tokenizer(spec.shape.vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


def write_tiny_pair(target: TinyLlama, draft: TinyLlama, directory: Path) -> tuple[Path, Path]:
    """A target and a draft model sharing one vocabulary, in ``directory/target`` and
    ``directory/draft``."""
    if target.shape.vocab_size != draft.shape.vocab_size:
        raise ValueError("a draft must share its target's vocabulary")
    return (write_tiny_llama(target, directory / "target"),
            write_tiny_llama(draft, directory / "draft"))
