"""The tokenizer's encoding releases the GIL and gives the same ids as a plain encode;
``max_chars_per_token`` is a sound bound (every text encodes to at least
``len(text) / bound`` tokens) and is ``None`` where no bound holds."""

from __future__ import annotations

import random
import sys
import threading

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers, trainers

from actors.config import DEFAULT_MODEL_DIR
from gpu.model.tokenizer import Tokenizer, max_chars_per_token

SAMPLES = ["", "hello", "  leading and trailing  ", "tabs\tand\nnewlines\n\n\n   x",
           "héllo wörld ✓ 中文 🙂 \u0301 combining", "<|endoftext|> special <|user|>",
           "def f(x):\n    return x * 2  # comment\n" * 20]


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    return Tokenizer.load(DEFAULT_MODEL_DIR)


def _random_texts(count: int) -> list[str]:
    rng = random.Random(7)
    alphabet = "ab cd\n\tééü中🙂 ,.;:'\"<|>0123456789" + "\u0301\u200b\x00"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400)))
            for _ in range(count)]


def test_encode_gives_the_ids_of_a_plain_encode(default_tokenizer: Tokenizer) -> None:
    backend = default_tokenizer._backend
    for text in SAMPLES + _random_texts(200):
        for special in (True, False):
            assert default_tokenizer.encode(text, add_special_tokens=special) == list(
                backend.encode(text, add_special_tokens=special).ids)


ENCODE_ATTEMPTS = 40
"""Encodings the GIL test offers the other thread (it needs the GIL during one)."""


def test_encoding_a_long_text_lets_other_threads_run(default_tokenizer: Tokenizer) -> None:
    """Another thread runs Python while a long text is being encoded.

    With a switch interval no test outlasts, the interpreter never takes the GIL from a
    running thread: it changes hands only where its holder blocks or releases it. The
    other thread, woken before the encoding starts, can then run only where the main
    thread lets the GIL go. It records whether an encoding was in progress when it ran:
    an encode that held the GIL throughout would let it run only after every encoding
    had ended. No clock is read: the encodings are offered until it has run."""
    text = "word " * 50_000
    encoding = [False]
    seen: list[bool] = []
    go = threading.Event()

    def look() -> None:
        go.wait()
        seen.append(encoding[0])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e6)
    try:
        other = threading.Thread(target=look)
        other.start()
        go.set()  # ``look`` is woken but waits for the GIL
        for _ in range(ENCODE_ATTEMPTS):
            if seen:
                break
            encoding[0] = True
            default_tokenizer.encode(text)
            encoding[0] = False
    finally:
        sys.setswitchinterval(interval)
    other.join()
    assert seen == [True]


def test_the_character_bound_holds(default_tokenizer: Tokenizer) -> None:
    bound = default_tokenizer.max_chars_per_token
    assert bound is not None and bound >= 1
    longest_run = " " * (bound * 3) + "x" + "\n" * (bound * 3)
    for text in SAMPLES + _random_texts(200) + [longest_run, "word " * 2000]:
        ids = default_tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) * bound >= len(text), text[:40]


def _trained(model: models.Model, trainer: trainers.Trainer, *,
             normalizer: normalizers.Normalizer | None = None) -> HFTokenizer:
    tokenizer = HFTokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10,
                                  trainer=trainer)
    return tokenizer


def test_no_bound_where_a_token_can_cover_any_length() -> None:
    word_level = _trained(models.WordLevel(unk_token="<unk>"),
                          trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    word_piece = _trained(models.WordPiece(unk_token="<unk>"),
                          trainers.WordPieceTrainer(special_tokens=["<unk>"]))
    fused_bpe = _trained(models.BPE(unk_token="<unk>", fuse_unk=True),
                         trainers.BpeTrainer(special_tokens=["<unk>"]))
    dropping_bpe = _trained(models.BPE(), trainers.BpeTrainer())
    composing = _trained(models.BPE(unk_token="<unk>"),
                         trainers.BpeTrainer(special_tokens=["<unk>"]),
                         normalizer=normalizers.NFC())
    for tokenizer in (word_level, word_piece, fused_bpe, dropping_bpe, composing):
        assert max_chars_per_token(tokenizer) is None
    plain_bpe = _trained(models.BPE(unk_token="<unk>"),
                         trainers.BpeTrainer(special_tokens=["<unk>"]),
                         normalizer=normalizers.Sequence([normalizers.NFD(),
                                                          normalizers.Lowercase()]))
    bound = max_chars_per_token(plain_bpe)
    assert bound is not None
    text = "Quick brown zzzz unknown ✓✓✓ " * 10
    assert len(plain_bpe.encode(text).ids) * bound >= len(text.replace(" ", ""))
