"""Rotary-embedding parameters of a checkpoint: parse and validate ``rope_scaling`` /
``rope_parameters`` from ``config.json``.

Owns ``RopeScaling``, the typed description of one rope variant (``default``,
``linear``, ``dynamic``, ``llama3``, ``yarn``, ``longrope``), read from either the
current ``rope_parameters`` layout or the older flat ``rope_theta`` plus
``rope_scaling`` (``type`` or ``rope_type``). It loads no torch: the frequencies are
computed by ``gpu.model.rope``. It refuses what it cannot reproduce exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

_ALIASES = {"su": "longrope"}
"""Older names transformers still reads."""


class RopeConfigError(ValueError):
    """Raised when a rope configuration is unknown or lacks a parameter; the caller
    turns it into an ``UnsupportedModelError``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """One rope variant's parameters (hashable: part of a capture's model key)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def context_limit(self, max_position_embeddings: int) -> int:
        """Longest sequence flare serves with this variant.

        ``longrope`` switches from the short to the long factors once a sequence
        passes ``original_max_position_embeddings`` (transformers rescales the whole
        sequence then); flare's tables are fixed at load, so it serves up to that
        length, where the short factors are exact."""
        if self.rope_type == "longrope":
            return min(max_position_embeddings, self.original_max_position_embeddings)
        return max_position_embeddings


def _number(params: dict[str, Any], key: str, rope_type: str) -> float:
    value = params.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RopeConfigError(f"rope scaling {rope_type!r} needs a numeric {key!r}")
    return float(value)


def _optional(params: dict[str, Any], key: str) -> float | None:
    value = params.get(key)
    return None if value is None else float(value)


def parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """The ``RopeScaling`` of a parsed ``config.json``."""
    params: dict[str, Any] = {}
    for source in (raw.get("rope_parameters"), raw.get("rope_scaling")):
        if isinstance(source, dict):
            params.update(source)
    rope_type = str(params.get("rope_type", params.get("type")) or "default")
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise RopeConfigError(
            f"rope scaling {rope_type!r} is not supported; flare supports rope types "
            + ", ".join(ROPE_TYPES))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise RopeConfigError(f"partial_rotary_factor {partial!r} is not supported; flare "
                              "rotates the whole head (1.0)")
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    original = int(params.get("original_max_position_embeddings")
                   or raw.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "default":
        return RopeScaling(theta=theta, original_max_position_embeddings=original)
    common: dict[str, Any] = dict(rope_type=rope_type, theta=theta,
                                  original_max_position_embeddings=original)
    if rope_type in ("linear", "dynamic"):
        return RopeScaling(**common, factor=_number(params, "factor", rope_type))
    if rope_type == "llama3":
        return RopeScaling(
            **common, factor=_number(params, "factor", rope_type),
            low_freq_factor=_number(params, "low_freq_factor", rope_type),
            high_freq_factor=_number(params, "high_freq_factor", rope_type))
    if rope_type == "yarn":
        factor = params.get("factor")
        return RopeScaling(
            **common,
            factor=float(factor) if factor is not None else max_position_embeddings / original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=_optional(params, "attention_factor"),
            mscale=_optional(params, "mscale"),
            mscale_all_dim=_optional(params, "mscale_all_dim"),
            truncate=bool(params.get("truncate", True)))
    # longrope
    short, long = params.get("short_factor"), params.get("long_factor")
    if not isinstance(short, list) or not isinstance(long, list):
        raise RopeConfigError("rope scaling 'longrope' needs short_factor and long_factor lists")
    factor = params.get("factor")
    return RopeScaling(
        **common,
        factor=float(factor) if factor is not None else max_position_embeddings / original,
        attention_factor=_optional(params, "attention_factor"),
        short_factor=tuple(float(v) for v in short), long_factor=tuple(float(v) for v in long))
