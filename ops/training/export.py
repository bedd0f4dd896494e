"""Writing a trained model as an HF-format checkpoint directory.

``config.json`` (a Llama config that transformers reads without warnings), ``model.safetensors``
(float32, HF parameter names), ``generation_config.json`` (greedy by default; both
``<|endoftext|>`` and ``<|end|>`` stop generation) and the tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer

from ops.training.llama import LlamaForCausalLM
from ops.training.special_tokens import END, END_OF_TEXT
from ops.training.tokenizer import special_token_ids, write_tokenizer_files

CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def llama_config(model: LlamaForCausalLM, bos_id: int, eos_id: int) -> dict[str, object]:
    """The ``config.json`` contents for ``model``."""
    shape = model.shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def write_checkpoint(
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    directory: Path,
    extra: dict[str, object] | None = None,
) -> int:
    """Write every checkpoint file into ``directory``; returns their total size in bytes.

    ``extra``, when given, goes to ``flare_training.json`` (the run's record, for docs).
    """
    directory.mkdir(parents=True, exist_ok=True)
    ids = special_token_ids(tokenizer)
    eos, end_of_turn = ids[END_OF_TEXT], ids[END]
    config = llama_config(model, bos_id=eos, eos_id=eos)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": eos,
        "eos_token_id": [eos, end_of_turn],
        "pad_token_id": eos,
        "do_sample": False,
        "max_new_tokens": 256,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(
        model.checkpoint_tensors(), str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    write_tokenizer_files(tokenizer, directory, model.shape.max_position_embeddings)
    if extra is not None:
        (directory / "flare_training.json").write_text(json.dumps(extra, indent=2) + "\n")
    return sum((directory / name).stat().st_size for name in CHECKPOINT_FILES)
