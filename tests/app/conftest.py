"""Fixtures for the HTTP-layer tests: a tokenizer trained once per session."""

from __future__ import annotations

import pytest
from http_fakes import TinyCodec, train_tokenizer
from tokenizers import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture
def codec(tokenizer: Tokenizer) -> TinyCodec:
    return TinyCodec(tokenizer)
