"""Prompt text of a target token length, built from a local tokenizer when there is one.

``TokenizerPrompts`` loads ``<model dir>/tokenizer.json`` with ``tokenizers`` and cuts
pseudo-random English-word text to exactly the target number of token ids before decoding
it (re-encoding decoded text can differ by a token or two at the cut; the exact count sent
is whatever the server reports in ``usage.prompt_tokens``). Without a tokenizer,
``WordPrompts`` uses one word per target token, an approximation that ``load_prompt_builder``
announces with a clear message. Both also count tokens in streamed text (used to weight
chunks), so the same choice governs prompt building and output counting.

Each request gets different text (drawn from its own seeded generator), so a prefix cache
cannot turn a load test into a cache test by accident.
"""

from __future__ import annotations

import pathlib
from typing import Protocol

import numpy as np

DEFAULT_MODEL_DIR = pathlib.Path(__file__).resolve().parents[2] / "models" / "default"

# Common English words: text that any byte-level BPE tokenizes to ordinary tokens.
_WORD_TEXT = """
the of and to in is was for on that with as by at from his her it an were are which this
be or had not but first one their its new after who they have two she been other when
there all during into school time may years more most only over city some world would
where later up such used many can state about national out known university united then
made between through long river since before both under three well year part against
while around people high still team found work each water small house early light music
story garden window morning market letter number simple quiet strong bright paper travel
winter summer island forest engine signal bridge mountain language history reason answer
question machine picture season station village ocean planet
"""
_WORDS = tuple(_WORD_TEXT.split())


class PromptBuilder(Protocol):
    """Builds prompt text of a target token length and counts tokens in text."""

    description: str

    def build(self, target_tokens: int, rng: np.random.Generator) -> str: ...

    def count_tokens(self, text: str) -> int: ...


def _random_words(count: int, rng: np.random.Generator) -> list[str]:
    picks = rng.integers(0, len(_WORDS), size=max(count, 0))
    return [_WORDS[int(i)] for i in picks]


class WordPrompts:
    """Fallback builder: one word per target token; counts whitespace-separated words."""

    description = "word-based prompts (no tokenizer: one word per target token, approximate)"

    def build(self, target_tokens: int, rng: np.random.Generator) -> str:
        return " ".join(_random_words(target_tokens, rng))

    def count_tokens(self, text: str) -> int:
        return len(text.split())


class TokenizerPrompts:
    """Builder over a local ``tokenizers.Tokenizer``: prompts cut to exact token counts."""

    def __init__(self, tokenizer_path: pathlib.Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.description = f"tokenizer prompts ({tokenizer_path})"

    def build(self, target_tokens: int, rng: np.random.Generator) -> str:
        if target_tokens <= 0:
            return ""
        ids: list[int] = []
        # Words are at least one token each, so this loop almost always runs once.
        while len(ids) < target_tokens:
            words = _random_words(target_tokens - len(ids) + 8, rng)
            text = (" " if ids else "") + " ".join(words)
            ids.extend(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return str(self._tokenizer.decode(ids[:target_tokens], skip_special_tokens=True))

    def count_tokens(self, text: str) -> int:
        if not text:
            return 0
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def load_prompt_builder(
    model_dir: pathlib.Path | None = None,
) -> tuple[PromptBuilder, str | None]:
    """The tokenizer-based builder for ``model_dir`` (default ``models/default``), or the
    word-based fallback plus a message saying why it was used."""
    directory = DEFAULT_MODEL_DIR if model_dir is None else model_dir
    path = directory / "tokenizer.json"
    if path.is_file():
        return TokenizerPrompts(path), None
    message = (
        f"no tokenizer at {path}; falling back to word-based prompts "
        "(one word per target token, so prompt lengths are approximate). "
        "Pass --model-dir with a tokenizer.json for exact lengths."
    )
    return WordPrompts(), message
