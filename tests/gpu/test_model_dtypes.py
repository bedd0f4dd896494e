"""Serving dtypes (``--dtype``): which dtype a load runs in, and bf16 / fp16
checkpoints served in their own dtype on the CPU backend.

Stated comparison for reduced precision: transformers run in the same dtype is the
peer. A bf16 or fp16 prefill's prompt log-probabilities agree with it within 0.02
(measured: equal), and greedy continuations agree over the first 8 tokens (bf16
rounding in decode attention, whose key extent differs from transformers', may flip a
near-tie later; float32 serving stays token-for-token equal over the whole horizon).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import CATALOG, DECODE, PAGE_SIZE, PREFILL_64, prompt_of
from variant_fixtures import build_variant, scored_logprobs

from gpu.engine import ModelEngine, resolve_dtype
from gpu.programs.driver import ReferenceDriver

HORIZON = 8
LOGPROB_TOLERANCE = 0.02


def test_dtype_rules() -> None:
    """auto: the checkpoint's dtype where the device runs it, else the device's
    default; an explicit dtype the device does not run is refused naming --dtype."""
    assert resolve_dtype("cpu", None) == torch.float32
    assert resolve_dtype("cpu", "auto", "bfloat16") == torch.bfloat16
    assert resolve_dtype("cpu", "auto", "float16") == torch.float16
    assert resolve_dtype("cpu", "auto", "float32") == torch.float32
    assert resolve_dtype("cpu", "float32", "bfloat16") == torch.float32
    assert resolve_dtype("cpu", torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("cuda:0", None) == torch.bfloat16
    assert resolve_dtype("cuda", "auto", "float32") == torch.bfloat16
    assert resolve_dtype("cuda", "auto", "float16") == torch.float16
    assert resolve_dtype("cuda", "float16") == torch.float16
    with pytest.raises(ValueError, match="--dtype float32 is not supported on the cuda"):
        resolve_dtype("cuda", "float32")
    with pytest.raises(ValueError, match="--dtype 'int8'"):
        resolve_dtype("cpu", "int8")


@pytest.fixture(scope="module")
def reduced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The llama3-rope GQA variant saved in bf16 and in fp16."""
    root = tmp_path_factory.mktemp("reduced")
    return {dtype: build_variant("llama3", root / dtype, dtype=dtype)
            for dtype in ("bfloat16", "float16")}


def _load(directory: Path, dtype: str) -> ModelEngine:
    return ModelEngine.load(directory, device="cpu", dtype=dtype, catalog=CATALOG,
                            page_size=PAGE_SIZE, num_pages=64, state_rows=8)


def _hf(directory: Path, dtype: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0,
                              eos_token_id=None, pad_token_id=0, bos_token_id=None)
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), generation_config=config)[
            0, len(prompt):].tolist()


def _greedy(engine: ModelEngine, prompt: list[int], new_tokens: int) -> list[int]:
    driver = ReferenceDriver(engine)
    tokens = [driver.prefill(PREFILL_64, 0, prompt, chunk=23)]
    while len(tokens) < new_tokens:
        tokens += driver.decode(DECODE[1], [0])
    return tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_reduced_precision_checkpoint_serves_in_its_dtype(
        dtype: str, reduced: dict[str, Path]) -> None:
    """``--dtype auto`` keeps the checkpoint's dtype for weights, cache and rope tables;
    prompt log-probabilities match transformers in that dtype, and so do greedy tokens
    over the stated horizon."""
    engine = _load(reduced[dtype], "auto")
    want = getattr(torch, dtype)
    decoder = engine.parts.decoder
    assert engine.dtype == want
    assert {decoder.embed.dtype, decoder.rope_cos.dtype, engine.parts.cache.keys.dtype} == {want}
    model = _hf(reduced[dtype], dtype)
    prompt = prompt_of(60, seed=3)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = reference[torch.arange(59), torch.tensor(prompt[1:])]
    got = scored_logprobs(engine, prompt)
    assert torch.allclose(got, expected, atol=LOGPROB_TOLERANCE, rtol=0)
    for seed in range(3):
        prompt = prompt_of(40, seed=seed)
        assert _greedy(_load(reduced[dtype], "auto"), prompt, HORIZON) == _hf_greedy(
            model, prompt, HORIZON)


def test_a_bf16_checkpoint_served_in_float32_equals_transformers_in_float32(
        reduced: dict[str, Path]) -> None:
    """``--dtype float32`` upcasts a bf16 checkpoint: token for token over 26 tokens."""
    engine = _load(reduced["bfloat16"], "float32")
    assert engine.dtype == torch.float32
    prompt = prompt_of(40, seed=0)
    assert _greedy(engine, prompt, 26) == _hf_greedy(_hf(reduced["bfloat16"], "float32"),
                                                     prompt, 26)
