"""Megatron-style shards (``gpu.model.sharding``) and a rank's own programs
(``gpu.backends.rank_programs``: rebuilt from the payload rank 0 broadcasts), in one
process: the ranks run as threads whose collectives are plain sums and
concatenations, so the sharded math is checked without a process group.

- which KV heads a rank holds: its share when there are at least as many KV heads as
  ranks, else the one its query heads read, replicated;
- a model that does not split fails with the dimension named;
- on every tiny family (GQA with 4/2 heads, q/k/v biases, per-head q/k norms, untied
  logits and 4 KV heads), at 4 ranks with 2 KV heads (replicated), and with
  vocabulary-parallel embedding and logits, a prefill then decodes on the shards give
  the tokens of the whole model, each rank with a KV pool of its heads only;
- what each rank holds: its share of the checkpoint, read from the files, while the
  host's programs hold placeholders without memory.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import threading
from pathlib import Path

import pytest
import torch
from model_fixtures import CATALOG, DECODE, PAGE_SIZE, PREFILL_64, prompt_of
from safetensors import safe_open

from gpu.backends.rank_programs import (
    held_bytes,
    model_parts,
    programs_payload,
    rank_programs,
)
from gpu.backends.ranks import vocab_parallel_default
from gpu.engine import ModelEngine
from gpu.frames import Frame, Result, as_inputs, result_of
from gpu.model.config import ModelConfig, ModelLoadError, load_model_config
from gpu.model.kv_cache import PagedKVCache
from gpu.model.sharding import Collectives, ShardError, check_shardable, kv_heads_of_rank
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


class _ThreadGroup:
    """The collectives of ranks that are threads of this process."""

    def __init__(self, world: int) -> None:
        self._parts: list[torch.Tensor] = [torch.empty(0)] * world
        self._written = threading.Barrier(world)
        self._read = threading.Barrier(world)

    def _exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._parts[rank] = tensor.clone()
        self._written.wait()
        parts = list(self._parts)
        self._read.wait()
        return parts

    def of_rank(self, rank: int) -> Collectives:
        group = self

        class _Rank:
            def all_reduce(self, tensor: torch.Tensor) -> None:
                tensor.copy_(sum(group._exchange(rank, tensor), torch.zeros_like(tensor)))

            def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
                return torch.cat(group._exchange(rank, tensor), dim=-1)

        return _Rank()


class _GroupDriver(ReferenceDriver):
    """The reference driver over ``world`` rank threads; returns rank zero's result
    after checking every rank sampled the same tokens."""

    def __init__(self, engine: ModelEngine, world: int, *, vocab_parallel: bool = False
                 ) -> None:
        super().__init__(engine)
        group = _ThreadGroup(world)
        shapes = list(engine.programs)
        payload = programs_payload(list(engine.programs.values()))
        self.ranks = [dict(zip(shapes, rank_programs(
            payload, r, world, group.of_rank(r), vocab_parallel=vocab_parallel), strict=True))
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


def _load(directory: Path, *, hold_model: bool = True) -> ModelEngine:
    return ModelEngine.load(directory, device="cpu", dtype=None, catalog=CATALOG,
                            page_size=PAGE_SIZE, num_pages=16, state_rows=2,
                            hold_model=hold_model)


@pytest.mark.parametrize(("kind", "world", "vocab_parallel"), [
    ("llama", 2, False), ("qwen2", 2, False), ("qwen3", 2, False), ("llama_untied", 2, False),
    ("llama", 4, False), ("llama", 2, True), ("llama_untied", 4, True)])
def test_shards_give_the_whole_models_tokens(kind: str, world: int, vocab_parallel: bool,
                                             tiny_checkpoints: dict[str, Path]) -> None:
    """The ranks read their shards from the checkpoint while the host's programs hold
    placeholders only; replicated or vocabulary-parallel logits alike."""
    prompt = prompt_of(30, seed=world)
    whole = _tokens(ReferenceDriver(_load(tiny_checkpoints[kind])), prompt)
    engine = _load(tiny_checkpoints[kind], hold_model=False)
    group = _GroupDriver(engine, world, vocab_parallel=vocab_parallel)
    assert _tokens(group, prompt) == whole
    kv = engine.config.num_kv_heads
    for rank, programs in enumerate(group.ranks):
        pools = [p for p in model_parts(list(programs.values())) if isinstance(p, PagedKVCache)]
        assert pools and all(p.keys.shape[3] == len(kv_heads_of_rank(kv, rank, world))
                             for p in pools)


def _share_of(name: str, elements: int, config: ModelConfig, rank: int, world: int, *,
              vocab_parallel: bool) -> float:
    """The share of tensor ``name``'s elements rank ``rank`` holds: Megatron's layout
    written out independently of ``ShardPlan``."""
    kv = config.num_kv_heads
    if any(p in name for p in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
        return elements / world
    if "k_proj" in name or "v_proj" in name:
        return elements * len(kv_heads_of_rank(kv, rank, world)) / kv
    if name in ("model.embed_tokens.weight", "lm_head.weight") and vocab_parallel:
        return elements / world
    return elements


@pytest.mark.parametrize(("kind", "world", "vocab_parallel"), [
    ("llama", 2, False), ("llama", 4, False), ("llama_untied", 2, True)])
def test_each_rank_holds_its_share_and_the_host_none(kind: str, world: int,
                                                     vocab_parallel: bool,
                                                     tiny_checkpoints: dict[str, Path]
                                                     ) -> None:
    """A host that leaves the model to its ranks (``hold_model=False``) holds no
    parameter and no KV page; each rank holds 1/N of every split tensor, its KV heads'
    share of the pool, and the rest whole, all read from the checkpoint's files."""
    directory = tiny_checkpoints[kind]
    whole = _load(directory)
    engine = _load(directory, hold_model=False)
    assert held_bytes(list(engine.programs.values())) == {"weights": 0, "packed": 0, "kv": 0}
    full = held_bytes(list(whole.programs.values()))
    config = engine.config
    element = torch.empty(0, dtype=engine.dtype).element_size()
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    group = _GroupDriver(engine, world, vocab_parallel=vocab_parallel)
    for rank, programs in enumerate(group.ranks):
        held = held_bytes(list(programs.values()))
        assert held["weights"] == element * sum(
            _share_of(name, math.prod(shape), config, rank, world, vocab_parallel=vocab_parallel)
            for name, shape in shapes.items())
        assert held["kv"] * config.num_kv_heads == \
            full["kv"] * len(kv_heads_of_rank(config.num_kv_heads, rank, world))


def test_the_vocabulary_layout_is_replicated_unless_flare_tp_vocab_says() -> None:
    assert vocab_parallel_default({}) is False
    assert vocab_parallel_default({"FLARE_TP_VOCAB": "parallel"}) is True
    assert vocab_parallel_default({"FLARE_TP_VOCAB": "replicated"}) is False
    with pytest.raises(ValueError, match="FLARE_TP_VOCAB"):
        vocab_parallel_default({"FLARE_TP_VOCAB": "sharded"})


def test_a_rank_reads_its_checkpoint_where_its_machine_keeps_it(
        tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """``flare rank --model DIR``: a rank whose machine keeps the served checkpoint
    elsewhere than the serving process reads its shard there."""
    served, elsewhere = tmp_path / "served", tmp_path / "elsewhere"
    shutil.copytree(tiny_checkpoints["llama"], served)
    shutil.copytree(served, elsewhere)
    payload = programs_payload(list(_load(served, hold_model=False).programs.values()))
    (served / "model.safetensors").unlink()  # not on the rank's machine
    with pytest.raises(ModelLoadError):
        rank_programs(payload, 0, 2, _ThreadGroup(2).of_rank(0))
    programs = rank_programs(payload, 0, 2, _ThreadGroup(2).of_rank(0),
                             checkpoints={"model": elsewhere})
    assert held_bytes(programs)["weights"] > 0
