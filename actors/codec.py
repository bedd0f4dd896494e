"""The runtime's ``TextCodec``: the checkpoint's tokenizer as the HTTP layer needs it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from actors.public import TextCodec
from gpu import Tokenizer


class TokenizerCodec:
    """``actors.public.TextCodec`` over ``gpu.model.tokenizer.Tokenizer``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    @property
    def max_chars_per_token(self) -> int | None:
        return self._tokenizer.max_chars_per_token

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self._tokenizer.eos_token_ids)

    @property
    def chat_template(self) -> str | None:
        return self._tokenizer.chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        tokens = {"bos_token": self._tokenizer.bos_token, "eos_token": self._tokenizer.eos_token}
        return {k: v for k, v in tokens.items() if v is not None}


if TYPE_CHECKING:  # ``TokenizerCodec`` satisfies the public protocol (checked by mypy --strict).
    _CODEC_IS_PUBLIC: type[TextCodec] = TokenizerCodec
