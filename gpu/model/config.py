"""Model configuration: parse and validate an HF-format ``config.json``.

Owns the one typed description of a decoder that the rest of ``gpu/`` reads
(vocabulary, layer geometry, rope, tied embeddings, EOS ids). It refuses anything it
cannot serve exactly, with a message naming what is supported: flare never loads a
model it would run wrongly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class UnsupportedModelError(ValueError):
    """Raised when a checkpoint uses an architecture or option flare cannot run."""


class ModelLoadError(ValueError):
    """Raised when a checkpoint directory is missing files or has malformed ones."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """The decoder geometry flare needs, read from ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def mixed_capture(self) -> bool:
        """Whether this family runs mixed programs (OPEN-25): every family flare loads
        does, at decode width one."""
        return True

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) the model was configured for."""
        return self.max_position_embeddings


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path.name} not found in {path.parent}") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _rope_theta(raw: dict[str, Any]) -> float:
    """rope_theta from the flat key or from ``rope_parameters``; refuse scaling."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    for source in (scaling, params):
        if isinstance(source, dict):
            rope_type = source.get("rope_type", source.get("type", "default"))
            if rope_type not in (None, "default"):
                raise UnsupportedModelError(
                    f"rope scaling {rope_type!r} is not supported; flare supports plain "
                    "rotary embeddings with rope_theta (no rope_scaling)"
                )
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta)


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> ModelConfig:
    """Build a ``ModelConfig`` from parsed ``config.json`` (and ``generation_config.json``)."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES or len(archs) != 1:
        raise UnsupportedModelError(
            f"architecture {archs!r} is not supported; flare supports "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        vocab = int(raw["vocab_size"])
        config = ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=tuple(dict.fromkeys(
                _as_ids((generation or {}).get("eos_token_id")) + _as_ids(raw.get("eos_token_id"))
            )),
            bos_token_id=raw.get("bos_token_id"),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks required key {exc.args[0]!r}") from exc
    if heads % kv_heads:
        raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
    if arch != "Qwen2ForCausalLM" and raw.get("attention_bias"):
        raise UnsupportedModelError(
            "attention_bias is not supported for this architecture; flare supports the "
            "q/k/v biases of Qwen2ForCausalLM only"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; flare supports 'silu'")
    if raw.get("use_sliding_window") and arch != "LlamaForCausalLM":
        raise UnsupportedModelError("sliding-window attention is not supported")
    return config


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a directory."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    raw = _read_json(directory / "config.json")
    gen_path = directory / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else None
    return parse_model_config(raw, generation)
