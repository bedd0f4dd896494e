"""Tokenizer: ``tokenizer.json`` plus ``tokenizer_config.json`` of an HF checkpoint.

Owns encoding, decoding, EOS ids, the BOS token and the chat template (rendered with
jinja2 the way HF does). It is host-only and never touches a device.

Encoding runs in Rust with the GIL released (``encode_batch_fast``), so a long text
encoded in a worker thread never stalls the threads that run the model or the event loop.
``max_chars_per_token`` bounds how much text one token can cover, so callers can refuse a
text that cannot fit a context before encoding it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from gpu.model.config import ModelLoadError

# Normalizers that never make a text shorter (so a token still covers at most as many input
# characters as its vocabulary string has).
_NON_SHRINKING_NORMALIZERS = frozenset({"Prepend", "NFD", "NFKD", "Lowercase"})


def _never_shrinks(normalizer: Mapping[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shrinks(n) for n in normalizer.get("normalizers", ()))
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        content = normalizer.get("content", "")
        return ("String" in pattern and isinstance(content, str)
                and len(content) >= len(pattern["String"]))
    return kind in _NON_SHRINKING_NORMALIZERS


def _has_byte_level(pre_tokenizer: Mapping[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") == "ByteLevel"


def max_chars_per_token(backend: HFTokenizer) -> int | None:
    """The most input characters one token of ``backend`` can cover, or ``None`` when no
    such bound holds (a normalizer that can delete or compose characters, an unknown token
    that swallows a whole word or run, a token that strips neighbouring whitespace).

    Sound: byte-level and metaspace pre-tokenizers map each input character to at least
    one vocabulary character, byte-fallback tokens cover at most one character, so a text
    of ``n`` characters encodes to at least ``n / max_chars_per_token`` tokens.
    """
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    kind = model.get("type")
    if not _never_shrinks(spec.get("normalizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    if kind == "BPE":
        every_char_encodes = model.get("byte_fallback") or _has_byte_level(
            spec.get("pre_tokenizer"))
        if model.get("unk_token") is None and not every_char_encodes:
            return None  # unknown characters are dropped
        if model.get("fuse_unk") and not every_char_encodes:
            return None  # a run of unknown characters is one token
    elif kind != "Unigram" or not model.get("byte_fallback"):
        return None  # WordLevel, WordPiece: a whole unknown word is one token
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = max((len(token) for token in vocab), default=1)
    return max(1, longest, *(len(t.get("content", "")) for t in added))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


class Tokenizer:
    """Encode/decode text and render chat prompts for one checkpoint."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: tuple[int, ...],
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        add_bos: bool,
    ) -> None:
        self._backend = backend
        self.eos_token_ids = eos_token_ids
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.max_chars_per_token = max_chars_per_token(backend)

    @classmethod
    def load(cls, model_dir: str | Path, *, extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
        """Read ``tokenizer.json`` and ``tokenizer_config.json`` from a directory."""
        directory = Path(model_dir)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"tokenizer.json not found in {directory}")
        backend = HFTokenizer.from_file(str(path))
        cfg_path = directory / "tokenizer_config.json"
        cfg: dict[str, Any] = (
            json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        )
        template = cfg.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        eos_token = _token_text(cfg.get("eos_token"))
        eos_ids = list(extra_eos_ids)
        if eos_token is not None:
            eos_id = backend.token_to_id(eos_token)
            if eos_id is not None:
                eos_ids.append(eos_id)
        return cls(
            backend,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=eos_token,
            chat_template=template,
            add_bos=bool(cfg.get("add_bos_token", False)),
        )

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar libraries read)."""
        return str(self._backend.to_str())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's special tokens by default).

        The same ids as ``encode``; the batch call releases the GIL while it runs."""
        [encoding] = self._backend.encode_batch_fast([text],
                                                     add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template (HF semantics)."""
        if not self.chat_template:
            raise ModelLoadError("this model has no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        def tojson(value: Any, indent: int | None = None) -> str:
            # HF's filter: no HTML escaping (jinja2's builtin escapes <, >, &).
            return json.dumps(value, ensure_ascii=False, indent=indent)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        template = env.from_string(self.chat_template)
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **dict(extra or {}),
        )
