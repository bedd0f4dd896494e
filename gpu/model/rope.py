"""Rotary position embeddings: the inverse frequencies of each rope variant and the
cos/sin tables the decoder reads.

Every variant is computed once, at load, for positions ``0..max_context-1``: prepared
programs have fixed shapes and are captured, so nothing here runs per forward. The
formulas follow transformers' ``modeling_rope_utils`` operation for operation (same
dtypes, same order), so the tables equal the reference's bit for bit in float32.

``dynamic`` (NTK) rescales the base only once a sequence grows past
``max_position_embeddings``; flare never serves beyond it (the context is capped
there), so within what flare serves its frequencies are the plain ones, as in
transformers. ``longrope`` is served with its short factors up to
``original_max_position_embeddings`` (``RopeScaling.context_limit``).
"""

from __future__ import annotations

import math

import torch

from gpu.model.rope_scaling import RopeScaling


def _plain(theta: float, dim: int, device: str) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta ** exponents)


def _llama3(rope: RopeScaling, dim: int, device: str) -> torch.Tensor:
    inv_freq = _plain(rope.theta, dim, device)
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeScaling, dim: int, device: str) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope(rope: RopeScaling, dim: int, device: str) -> tuple[torch.Tensor, float]:
    if len(rope.short_factor) != dim // 2:
        raise ValueError(f"longrope short_factor has {len(rope.short_factor)} entries, "
                         f"expected head_dim / 2 = {dim // 2}")
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if rope.factor <= 1.0 else math.sqrt(
            1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    ext = torch.tensor(rope.short_factor, dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * rope.theta ** shape), float(attention)


def inverse_frequencies(rope: RopeScaling, head_dim: int, device: str
                        ) -> tuple[torch.Tensor, float]:
    """``(inv_freq float32 [head_dim / 2], attention factor)`` of ``rope``."""
    if rope.rope_type in ("default", "dynamic"):
        return _plain(rope.theta, head_dim, device), 1.0
    if rope.rope_type == "linear":
        return _plain(rope.theta, head_dim, device) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, head_dim, device), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, device)
    if rope.rope_type == "longrope":
        return _longrope(rope, head_dim, device)
    raise ValueError(f"rope type {rope.rope_type!r} has no frequencies")


def rope_tables(rope: RopeScaling, head_dim: int, max_context: int, *, device: str,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[max_context, head_dim]`` in ``dtype`` (computed in float32,
    scaled by the variant's attention factor, then cast, as transformers does)."""
    inv_freq, attention = inverse_frequencies(rope, head_dim, device)
    t = torch.arange(max_context, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos.to(dtype), sin.to(dtype)
