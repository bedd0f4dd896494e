"""Fixtures for the HTTP-layer tests: a tokenizer trained once per session."""

from __future__ import annotations

import pytest
from http_fakes import TinyCodec, train_tokenizer
from tokenizers import Tokenizer

from actors.config import RuntimeConfig


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture
def codec(tokenizer: Tokenizer) -> TinyCodec:
    return TinyCodec(tokenizer)


@pytest.fixture
def runtime_opened(monkeypatch: pytest.MonkeyPatch) -> list[RuntimeConfig]:
    """A stand-in ``open_runtime`` for ``flare run``: records every call and fails it,
    so a test sees whether anything started loading (nothing may after a refused flag
    or a start-up failure)."""
    calls: list[RuntimeConfig] = []

    def record(config: RuntimeConfig) -> object:
        calls.append(config)
        raise AssertionError("nothing may load after a refused flag or a start-up failure")

    monkeypatch.setattr("ops.run_command.open_runtime", record)
    return calls
