"""Model configuration: parse and validate an HF-format ``config.json``.

Owns the one typed description of a decoder that the rest of ``gpu/`` reads
(vocabulary, layer geometry, rope variant, per-layer sliding windows, family options,
tied embeddings, EOS ids, the checkpoint's dtype). It refuses anything it cannot serve
exactly, with a message naming what is supported: flare never loads a model it would
run wrongly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu.model.rope_scaling import RopeConfigError, RopeScaling, parse_rope

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM")
_GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
"""MLP activations (``hidden_act``) the decoder implements."""
_SLIDING_BY_LAYER_TYPE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""Families whose sliding window applies to the layers ``use_sliding_window`` and
``max_window_layers`` (or ``layer_types``) select; Mistral's applies to every layer,
Gemma2's to the layers ``layer_types`` marks (default: every other one, from the
first)."""


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
    rope: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: the sliding-window width (a query sees the keys of its last
    ``window`` positions, itself included), or None for full causal attention."""
    hidden_act: str = "silu"
    gemma_norms: bool = False
    """Gemma, Gemma2: RMSNorm scales by ``1 + weight`` (in float32) and the embeddings
    are multiplied by ``sqrt(hidden_size)``."""
    sandwich_norms: bool = False
    """Gemma2: attention and MLP outputs are normed before their residual add
    (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the MLP input by
    ``pre_feedforward_layernorm``."""
    attention_scale: float | None = None
    """Query scaling of attention scores (None: ``head_dim ** -0.5``)."""
    attention_softcap: float | None = None
    """Gemma2: scores become ``cap * tanh(scores / cap)`` before the mask."""
    final_softcap: float | None = None
    """Gemma2: logits become ``cap * tanh(logits / cap)``."""
    torch_dtype: str | None = None
    """The checkpoint's declared dtype (``dtype`` or ``torch_dtype``), if any."""

    @property
    def mixed_capture(self) -> bool:
        """Whether this family runs mixed programs (OPEN-25): every family flare loads
        does, at decode width one."""
        return True

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) flare serves for this model: the model's
        ``max_position_embeddings``, or less where its rope variant is exact only below
        that (``RopeScaling.context_limit``)."""
        return self.rope.context_limit(self.max_position_embeddings)

    def parameter_count(self) -> int:
        """Weights the decoder holds: embeddings (and an untied output head), each
        layer's attention and gated MLP projections, and the norms (biases left out:
        they are a rounding error)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        layer = h * q * 2 + h * kv * 2 + 3 * h * self.intermediate_size + 4 * h
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * h + self.num_layers * layer + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token position takes across every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else None


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


def _layer_windows(raw: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies it for ``arch``."""
    window = raw.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (int(window) if window else None,) * layers
    if arch == "Gemma2ForCausalLM":
        types = raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        return _windows_of(types, window, layers)
    if arch not in _SLIDING_BY_LAYER_TYPE or not raw.get("use_sliding_window") or not window:
        return (None,) * layers  # Llama and Gemma read no sliding window
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)]
    return _windows_of(types, window, layers)


def _windows_of(types: list[str], window: Any, layers: int) -> tuple[int | None, ...]:
    if len(types) != layers:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {layers} layers")
    return tuple(int(window) if window and t == "sliding_attention" else None for t in types)


def _activation(raw: dict[str, Any], arch: str) -> str:
    keys = ("hidden_activation", "hidden_act") if arch == "Gemma2ForCausalLM" else (
        "hidden_act", "hidden_activation")  # the key each family's transformers reads
    act = str(raw.get(keys[0]) or raw.get(keys[1]) or "silu")
    if arch in _GEMMA and act == "gelu":
        act = "gelu_pytorch_tanh"  # as transformers: Gemma's legacy "gelu" means tanh
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden_act {act!r} is not supported; flare supports " + ", ".join(ACTIVATIONS))
    return act


def _gemma2_options(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    if arch != "Gemma2ForCausalLM":
        return {}

    def optional(key: str, default: float | None) -> float | None:
        value = raw.get(key, default)
        return None if value is None else float(value)

    return dict(sandwich_norms=True,
                attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
                attention_softcap=optional("attn_logit_softcapping", 50.0),
                final_softcap=optional("final_logit_softcapping", 30.0))


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
        layers = int(raw["num_hidden_layers"])
        max_positions = int(raw.get("max_position_embeddings", 2048))
        try:
            rope = parse_rope(raw, max_positions)
        except RopeConfigError as exc:
            raise UnsupportedModelError(str(exc)) from exc
        dtype = raw.get("dtype") or raw.get("torch_dtype")
        config = ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope=rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get(
                "tie_word_embeddings", arch in _GEMMA)),  # transformers' defaults
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=tuple(dict.fromkeys(
                _as_ids((generation or {}).get("eos_token_id")) + _as_ids(raw.get("eos_token_id"))
            )),
            bos_token_id=raw.get("bos_token_id"),
            layer_windows=_layer_windows(raw, arch, layers),
            hidden_act=_activation(raw, arch),
            gemma_norms=arch in _GEMMA,
            **_gemma2_options(raw, arch),
            torch_dtype=str(dtype) if dtype else None,
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
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention is not supported; flare "
                                    "serves causal decoders")
    return config


def read_config_json(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``config.json`` and ``generation_config.json`` (None if absent) of a directory."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    raw = _read_json(directory / "config.json")
    gen_path = directory / "generation_config.json"
    return raw, _read_json(gen_path) if gen_path.exists() else None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a directory."""
    return parse_model_config(*read_config_json(model_dir))
