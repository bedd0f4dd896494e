"""Tiny random checkpoints of every rope variant and family beyond the plain ones of
``model_fixtures``: rope scaling (llama3, linear, dynamic, yarn, longrope), sliding
windows (Mistral, Qwen2 and Qwen3 with ``use_sliding_window``), Gemma, and a bf16
Llama-3-style checkpoint.

Norm weights and biases are randomised (transformers initialises them to 1 and 0,
which would hide a norm or bias applied wrongly). Windows are narrower than prompt +
generation and not page multiples, so they cut inside pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_fixtures import _common, _write_tokenizer

WINDOW = 21
"""Sliding window of the windowed variants: below every test's prompt + output length
and not a multiple of the 16-token page."""

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", dict(rope_scaling=_LLAMA3, head_dim=16)),
    "linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "yarn": ("LlamaConfig", dict(head_dim=16, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "longrope": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.5, 4.0],
        "long_factor": [2.0, 3.0, 5.0, 9.0], "original_max_position_embeddings": 256})),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=8)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1, tie_word_embeddings=False)),
    "qwen3_window": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1, head_dim=16)),
    "gemma": ("GemmaConfig", dict(head_dim=8, hidden_act="gelu_pytorch_tanh",
                                  tie_word_embeddings=True, pad_token_id=0)),
    # soft caps low enough to bind at these logit scales; windowed layers 0 and 2
    "gemma2": ("Gemma2Config", dict(head_dim=8, num_hidden_layers=3, sliding_window=WINDOW,
                                    query_pre_attn_scalar=12, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=5.0, pad_token_id=0)),
}


def randomise_norms_and_biases(model: Any, seed: int, *, gemma: bool) -> None:
    """Norm weights around 1 (Gemma stores offsets from 1: around 0) and non-zero
    biases, drawn from ``seed``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                noise = torch.randn(param.shape, generator=generator) * 0.3
                param.copy_(noise if gemma else 1.0 + noise)
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def build_variant(kind: str, directory: Path, *, dtype: str = "float32") -> Path:
    """Write checkpoint ``kind`` of ``VARIANTS`` (random weights, seeded by name) with
    the word-level test tokenizer, in ``dtype``."""
    import torch
    import transformers as tf

    class_name, extra = VARIANTS[kind]
    seed = sum(map(ord, kind))
    torch.manual_seed(seed)
    config = getattr(tf, class_name)(**_common(**{"tie_word_embeddings": True, **extra}))
    model_class = getattr(tf, class_name.replace("Config", "ForCausalLM"))
    model = model_class(config)
    randomise_norms_and_biases(model, seed, gemma=class_name.startswith("Gemma"))
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory)
    _write_tokenizer(directory)
    return directory


def scored_logprobs(engine: Any, prompt: list[int]) -> Any:
    """Every prompt token's log-probability after the first (float32 ``[len - 1]``),
    from one scored prefill of ``prompt`` (at most 64 tokens) in row 0."""
    import torch
    from model_fixtures import PAGE_SIZE, SCORED_64

    from gpu.frames import PageAppend, PrefillFrame, RowInit, StepResult, as_inputs, result_of

    assert len(prompt) <= SCORED_64.token_capacity
    program = engine.programs[SCORED_64]
    pages = tuple(range(-(-len(prompt) // PAGE_SIZE)))
    program.bind(as_inputs(PrefillFrame(
        row=0, tokens=tuple(prompt), start_position=0, ends_prompt=True, following_token=-1,
        updates=(RowInit(row=0), PageAppend(row=0, first_block=0, page_ids=pages)))))
    program.execute()
    result = result_of(program.read_outputs())
    assert isinstance(result, StepResult) and result.prompt_logprobs is not None
    return torch.tensor(result.prompt_logprobs[:-1])
