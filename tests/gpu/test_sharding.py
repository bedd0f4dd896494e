"""Megatron-style shards (``gpu.model.sharding``) and a rank's own programs
(``gpu.backends.rank_programs``), in one process: the ranks run as threads whose
all-reduce is a plain sum, so the sharded math is checked without a process group.

- which KV heads a rank holds: its share when there are at least as many KV heads as
  ranks, else the one its query heads read, replicated;
- a model that does not split fails with the dimension named;
- on every tiny family (GQA with 4/2 heads, q/k/v biases, per-head q/k norms, untied
  logits and 4 KV heads), and at 4 ranks with 2 KV heads (replicated), a prefill then
  decodes on the shards give the tokens of the whole model, each rank with a KV pool
  of its heads only.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from model_fixtures import CATALOG, DECODE, PAGE_SIZE, PREFILL_64, prompt_of

from gpu.backends.rank_programs import model_parts, rank_programs
from gpu.engine import ModelEngine
from gpu.frames import Frame, Result, as_inputs, result_of
from gpu.model.config import load_model_config
from gpu.model.kv_cache import PagedKVCache
from gpu.model.sharding import ShardError, check_shardable, kv_heads_of_rank
from gpu.programs.driver import ReferenceDriver
from policy.descriptors import GraphShape


def test_kv_heads_of_each_rank() -> None:
    assert [kv_heads_of_rank(4, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [kv_heads_of_rank(2, r, 4) for r in range(4)] == [range(0, 1), range(0, 1),
                                                             range(1, 2), range(1, 2)]
    assert [kv_heads_of_rank(1, r, 2) for r in range(2)] == [range(0, 1), range(0, 1)]


def test_a_model_that_does_not_split_names_the_dimension(
        tiny_checkpoints: dict[str, Path]) -> None:
    config = load_model_config(tiny_checkpoints["llama"])  # 4 heads, 2 KV heads, MLP 64
    check_shardable(config, 4)
    with pytest.raises(ShardError, match="attention heads"):
        check_shardable(config, 3)
    with pytest.raises(ShardError, match="KV heads"):
        check_shardable(dataclasses.replace(config, num_kv_heads=3, num_heads=6), 2)
    with pytest.raises(ShardError, match="MLP width"):
        check_shardable(dataclasses.replace(config, intermediate_size=66), 4)


class _ThreadSum:
    """An all-reduce for ranks that are threads of this process."""

    def __init__(self, world: int) -> None:
        self._parts: list[torch.Tensor | None] = [None] * world
        self._written = threading.Barrier(world)
        self._read = threading.Barrier(world)

    def of_rank(self, rank: int):  # type: ignore[no-untyped-def]
        def all_reduce(tensor: torch.Tensor) -> None:
            self._parts[rank] = tensor.clone()
            self._written.wait()
            total = sum(p for p in self._parts if p is not None)
            self._read.wait()
            tensor.copy_(total)
        return all_reduce


class _GroupDriver(ReferenceDriver):
    """The reference driver over ``world`` rank threads; returns rank zero's result
    after checking every rank sampled the same tokens."""

    def __init__(self, engine: ModelEngine, world: int) -> None:
        super().__init__(engine)
        summer = _ThreadSum(world)
        shapes = list(engine.programs)
        self.ranks = [dict(zip(shapes, rank_programs(list(engine.programs.values()), r, world,
                                                     summer.of_rank(r)), strict=True))
                      for r in range(world)]

    def run(self, shape: GraphShape, frame: Frame) -> Result:  # type: ignore[override]
        results: list[Result | None] = [None] * len(self.ranks)

        def one(rank: int) -> None:
            program = self.ranks[rank][shape]
            program.bind(as_inputs(frame))
            program.execute()
            results[rank] = result_of(program.read_outputs())

        threads = [threading.Thread(target=one, args=(r,)) for r in range(len(self.ranks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len({repr(r) for r in results}) == 1  # same samples on every rank
        assert results[0] is not None
        return results[0]


def _tokens(driver: ReferenceDriver, prompt: list[int]) -> list[int]:
    tokens = [driver.prefill(PREFILL_64, 0, prompt, chunk=23)]
    while len(tokens) < 8:
        tokens += driver.decode(DECODE[1], [0])
    return tokens


@pytest.mark.parametrize(("kind", "world"), [("llama", 2), ("qwen2", 2), ("qwen3", 2),
                                             ("llama_untied", 2), ("llama", 4)])
def test_shards_give_the_whole_models_tokens(kind: str, world: int,
                                             tiny_checkpoints: dict[str, Path]) -> None:
    engine = ModelEngine.load(tiny_checkpoints[kind], device="cpu", dtype=None,
                              catalog=CATALOG, page_size=PAGE_SIZE, num_pages=16, state_rows=2)
    prompt = prompt_of(30, seed=world)
    whole = _tokens(ReferenceDriver(engine), prompt)
    group = _GroupDriver(engine, world)
    assert _tokens(group, prompt) == whole
    kv = engine.config.num_kv_heads
    for rank, programs in enumerate(group.ranks):
        pools = [p for p in model_parts(list(programs.values())) if isinstance(p, PagedKVCache)]
        assert pools and all(p.keys.shape[3] == len(kv_heads_of_rank(kv, rank, world))
                             for p in pools)
