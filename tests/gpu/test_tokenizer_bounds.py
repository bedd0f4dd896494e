"""The tokenizer's encoding releases the GIL and gives the same ids as a plain encode;
``max_chars_per_token`` is a sound bound (every text encodes to at least
``len(text) / bound`` tokens) and is ``None`` where no bound holds."""

from __future__ import annotations

import random
import threading
import time

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


def test_encoding_a_long_text_lets_other_threads_run(default_tokenizer: Tokenizer) -> None:
    """While a long text is encoded, another thread keeps running Python: its longest
    pause is a small part of the encoding (a GIL-holding encode pauses it throughout)."""
    text = "word " * 200_000
    running = threading.Event()
    done = threading.Event()
    longest_pause = [0.0]

    def count() -> None:
        last = time.perf_counter()
        running.set()
        while not done.is_set():
            now = time.perf_counter()
            longest_pause[0] = max(longest_pause[0], now - last)
            last = now

    counter = threading.Thread(target=count)
    counter.start()
    assert running.wait(10)
    longest_pause[0] = 0.0
    began = time.perf_counter()
    default_tokenizer.encode(text)
    took = time.perf_counter() - began
    done.set()
    counter.join(10)
    assert took > 0.05  # long enough for the ratio to mean something
    assert longest_pause[0] < took / 3, (longest_pause[0], took)


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
