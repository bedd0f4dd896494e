"""The weight and KV sizes ``--gpu-memory-utilization`` sizes the KV pool with, checked
against what the embedded checkpoints hold and what a KV pool allocates."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from safetensors import safe_open

from actors.config import DEFAULT_DRAFT_DIR, DEFAULT_MODEL_DIR
from gpu import device_memory, load_model_config
from gpu.model.kv_cache import CacheGeometry, PagedKVCache


@pytest.mark.parametrize("model_dir", [DEFAULT_MODEL_DIR, DEFAULT_DRAFT_DIR],
                         ids=["target", "draft"])
def test_parameter_count_matches_the_checkpoint(model_dir: pathlib.Path) -> None:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    assert load_model_config(model_dir).parameter_count() == pytest.approx(stored, rel=0.01)


def test_kv_bytes_per_token_matches_the_cache_pool() -> None:
    config = load_model_config(DEFAULT_MODEL_DIR)
    geometry = CacheGeometry(page_size=16, num_pages=8, max_context=128)
    cache = PagedKVCache(config, geometry, device="cpu", dtype=torch.float32)
    allocated = sum(t.numel() * t.element_size() for t in (cache.keys, cache.values))
    # one page more than asked: the sink page inactive lanes write to
    assert allocated == config.kv_bytes_per_token(4) * 16 * (8 + 1)


def test_a_cpu_has_no_device_memory_to_size() -> None:
    assert device_memory("cpu") is None


@pytest.mark.cuda
def test_a_cuda_device_reports_free_and_total_memory() -> None:
    probed = device_memory("cuda:0")
    assert probed is not None and 0 < probed[0] <= probed[1]
