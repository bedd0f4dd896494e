"""The roofline cost model: memory-bound decode, a compute knee, published step times.

Decode time grows slowly with the batch (only the KV reads grow) until the tokens a
step processes reach the knee; a mixed frame's first prompt tokens ride on the weight
reads; a prompt token's cost past the knee is flat whatever the chunk; the model stays
within its stated tolerance of the published figures ``docs/simulator.md`` cites; the
tables it makes are labelled synthetic (VER-36).
"""

from __future__ import annotations

import pytest

from ops.sim.catalogs import build_catalogs
from ops.sim.roofline import (
    COST_MODELS,
    H100_SXM,
    H200_SXM,
    LLAMA3_8B,
    ROOFLINE_MODELS,
    RooflineCosts,
    named_cost_table,
)
from policy.descriptors import GraphKind, GraphShape, TargetBinding

MODEL = ROOFLINE_MODELS["roofline-llama3-8b-h100"]


def decode(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1,
                      packed_capacity=b)


def prefill(c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=c)


def mixed(b: int, c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=1,
                      prefill_capacity=c, packed_capacity=c + b - 1)


def test_llama3_8b_arithmetic() -> None:
    assert LLAMA3_8B.weight_bytes == pytest.approx(16.06e9)
    assert LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per position
    # the knee: the weight-read time at 80 % of 3.35 TB/s, spent at 55 % of 989 TFLOPS
    weight_s = 16.06e9 / (3.35e12 * 0.8)
    assert MODEL.knee_tokens() == pytest.approx(weight_s * 989e12 * 0.55 / (2 * 8.03e9))
    assert 150 < MODEL.knee_tokens() < 260


def test_decode_is_memory_bound_until_the_knee() -> None:
    one, sixteen, sixty_four = (MODEL.mean_ms(decode(b)) for b in (1, 16, 64))
    assert one == pytest.approx(1.5 + 1e3 * (16.06e9 + 1024 * 131072 + 131072)
                                / (3.35e12 * 0.8), rel=1e-6)
    # 16x the rows, less than 1.2x the time: only the KV reads grow
    assert sixteen / one < 1.2
    assert sixty_four / one < 1.6
    # far past the knee a step is compute-bound: time grows with the tokens
    wide = MODEL.target_ms(tokens=2048, rows=2048)
    assert wide > 3 * sixty_four


def test_first_prompt_tokens_of_a_mixed_frame_are_nearly_free() -> None:
    alone = MODEL.mean_ms(decode(16))
    assert MODEL.mean_ms(mixed(16, 128)) < 1.02 * alone
    # past the knee every further prompt token costs the compute price
    per_token = 2 * 8.03e9 / (989e12 * 0.55) * 1e3
    step = MODEL.mean_ms(mixed(16, 1024)) - MODEL.mean_ms(mixed(16, 768))
    assert step == pytest.approx(256 * per_token, rel=0.1)


def test_prefill_cost_per_token_is_flat_past_the_knee() -> None:
    def per_token(c: int) -> float:
        return (MODEL.mean_ms(prefill(2 * c)) - MODEL.mean_ms(prefill(c))) / c

    assert per_token(512) == pytest.approx(per_token(1024), rel=0.1)
    assert per_token(1024) == pytest.approx(per_token(2048), rel=0.15)  # attention grows
    # below the knee a bigger chunk costs almost nothing more
    assert MODEL.mean_ms(prefill(128)) - MODEL.mean_ms(prefill(64)) < 0.2


def test_speculative_rounds_pay_draft_steps() -> None:
    plain = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=8, token_capacity=1,
                       proposal_depth=0, packed_capacity=8,
                       binding=TargetBinding.QUERY_LENGTH)
    deep = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=8, token_capacity=5,
                      proposal_depth=4, packed_capacity=40,
                      binding=TargetBinding.QUERY_LENGTH)
    assert MODEL.mean_ms(deep) - MODEL.mean_ms(plain) == pytest.approx(
        MODEL.draft_ms(8, 4) + MODEL.target_ms(tokens=40, rows=8)
        - MODEL.target_ms(tokens=8, rows=8))
    assert MODEL.draft_ms(8, 4) == pytest.approx(4 * MODEL.draft_ms(8, 1))


@pytest.mark.parametrize(("concurrency", "published_ms"), [(1, 4.63), (50, 5.91), (100, 7.57)])
def test_fp8_decode_within_fifteen_percent_of_nim_itl(concurrency: int,
                                                      published_ms: float) -> None:
    """NVIDIA NIM 1.8.0, Llama-3.1-8B-Instruct, inter-token latency by concurrency
    (docs/simulator.md, Roofline), against the fp8 variant at 1024 context positions."""
    fp8 = ROOFLINE_MODELS["roofline-llama3-8b-h100-fp8"]
    ms = fp8.target_ms(tokens=concurrency, rows=concurrency)
    assert ms == pytest.approx(published_ms, rel=0.15)


def test_bf16_h200_batch_of_eight_within_fifteen_percent_of_vllm_latency() -> None:
    """vLLM's nightly latency test: Llama-3.1-8B, batch 8, 32 prompt and 128 output
    tokens, 833 ms mean end to end on one H200 (docs/simulator.md, Roofline)."""
    h200 = RooflineCosts(device=H200_SXM, context_tokens=32 + 64)
    total = (h200.target_ms(tokens=0, rows=0, prompt_tokens=8 * 32)
             + 128 * h200.target_ms(tokens=8, rows=8))
    assert total == pytest.approx(833.4, rel=0.15)
    assert H100_SXM.memory_bandwidth < H200_SXM.memory_bandwidth


def test_named_tables_cover_the_catalog_and_are_synthetic() -> None:
    catalog = build_catalogs(max_batch=8, prefill_capacities=(64, 256),
                             mixed_prefill=True).speculative
    for name in COST_MODELS:
        table = named_cost_table(name, catalog)
        assert set(table.mean_ns) == set(catalog)
        assert all(ns > 0 for ns in table.mean_ns.values())
        assert table.synthetic
    assert named_cost_table("roofline-llama3-8b-h100", catalog).source.startswith("roofline")
    with pytest.raises(ValueError, match="unknown cost model"):
        named_cost_table("nope", catalog)
