"""A plain-Python reference for logit processing, token by token (vLLM's semantics:
bias; repetition penalty over prompt and output tokens; frequency and presence
penalties over output counts; ending tokens forbidden under ``min_tokens``)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from gpu.frames import SamplingParams


def reference_logits(logits: list[float], s: SamplingParams, *, prompt: list[int],
                     outputs: list[int], ends: set[int]) -> list[float]:
    counts = Counter(outputs)
    bias = dict(s.logit_bias)
    out = []
    for token, x in enumerate(logits):
        x = x + bias.get(token, 0.0)
        if token in prompt or counts[token] > 0:
            x = x / s.repetition_penalty if x > 0 else x * s.repetition_penalty
        x = x - s.frequency_penalty * counts[token] - s.presence_penalty * (counts[token] > 0)
        if len(outputs) < s.min_tokens and token in ends:
            x = -math.inf
        out.append(x)
    return out


def reference_greedy(model: object, prompt: list[int], new_tokens: int, s: SamplingParams, *,
                     ends: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Greedy decoding of a transformers ``model`` with the reference processing."""
    outputs: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.tensor([prompt + outputs])
            logits = model(ids).logits[0, -1].float().tolist()  # type: ignore[operator]
            processed = reference_logits(logits, s, prompt=prompt, outputs=outputs, ends=ends)
            outputs.append(max(range(len(processed)), key=processed.__getitem__))
    return outputs
