"""Training the default model's byte-level BPE tokenizer and writing its HF files.

Byte-level means every byte has a token, so any text round-trips exactly. The special tokens of
``special_tokens.py`` get the lowest ids. ``write_tokenizer_files`` writes ``tokenizer.json`` and
a ``tokenizer_config.json`` carrying the chat template, EOS/BOS and ``model_max_length``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ops.training.special_tokens import CHAT_TEMPLATE, END, END_OF_TEXT, SPECIAL_TOKENS

DEFAULT_VOCAB_SIZE = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (special tokens included) trained on ``texts``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Each special token's id; raises if the tokenizer lacks one."""
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token} token")
        ids[token] = token_id
    return ids


def write_tokenizer_files(tokenizer: Tokenizer, directory: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = special_token_ids(tokenizer)
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, token_id in sorted(ids.items(), key=lambda item: item[1])
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != END_OF_TEXT],
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        # Not a transformers key: the assistant turn ends with <|end|>, which servers should
        # also treat as a stop token (generation_config.json lists both).
        "end_of_turn_token": END,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
