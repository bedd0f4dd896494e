"""Execution options: eager programs (dynamic context, greedy shortcut) give exactly the
tokens the static, capturable programs give, while reading only the context they need.

Covers MIX-15 (inactive lanes mutate nothing whatever the bound), MIX-33/MIX-38 (one
shared forward for the mixed phases, each phase with its own context bound) and the
prepared-program contract (static shapes stay the CUDA default; host bounds are refused
there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import CATALOG, DECODE, MIXED_4, PAGE_SIZE, PREFILL_64, prompt_of

from gpu.engine import ModelEngine
from gpu.frames import GREEDY, NO_PROMPT_ROW, SamplingParams
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import (
    ExecutionOptions,
    context_blocks,
    covering_power_of_two,
    power_of_two_buckets,
)
from gpu.sampling import sample


def _engine(model_dir: Path, execution: ExecutionOptions) -> ModelEngine:
    return ModelEngine.load(model_dir, device="cpu", dtype=None, catalog=CATALOG,
                            page_size=PAGE_SIZE, num_pages=96, state_rows=8,
                            execution=execution)


def _scenario(driver: ReferenceDriver) -> tuple[list[object], list[float], list[int]]:
    """Prefill, decode and mixed frames whose contexts cross many block counts, with greedy and seeded-sampling lanes; returns every sampled token, the
    mixed frames' logprobs and the context blocks each step program chose."""
    out: list[object] = []
    logprobs: list[float] = []
    blocks: list[int] = []
    engine = driver.engine
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7)
    lengths = {0: 5, 1: 40, 2: 150, 3: 200}
    for row, length in lengths.items():
        params = sampled if row == 2 else GREEDY
        out.append(driver.prefill(PREFILL_64, row, prompt_of(length, seed=row), chunk=64,
                                  sampling=params))
        blocks.append(engine.programs[PREFILL_64].context_blocks)  # type: ignore[attr-defined]
    for capacity, rows in ((1, [0]), (2, [0, 1]), (4, [3, 0, 2]), (8, [1, 2, 3, 0])):
        for _ in range(3):
            out.append(driver.decode(DECODE[capacity], rows))
            blocks.append(engine.programs[DECODE[capacity]].context_blocks)  # type: ignore[attr-defined]
    # mixed: a new prompt beside long decode lanes, then a long prompt beside short ones
    prompt = prompt_of(60, seed=9)
    result = driver.mixed(MIXED_4, [0, 4, 1], prefill_row=1, prompt=prompt[:30],
                          prompt_start=0, prompt_ends=False)
    out.append([(s.row, s.token) for s in result.samples])
    logprobs += [s.logprob for s in result.samples]
    program = engine.programs[MIXED_4]
    blocks += [program.context_blocks, program.prompt_blocks]  # type: ignore[attr-defined]
    result = driver.mixed(MIXED_4, [3, 2, 4], prefill_row=2, prompt=prompt[30:],
                          prompt_start=30, prompt_ends=True)
    out.append([(s.row, s.token) for s in result.samples])
    logprobs += [s.logprob for s in result.samples]
    result = driver.mixed(MIXED_4, [4, 0], prefill_row=NO_PROMPT_ROW)
    out.append([(s.row, s.token) for s in result.samples])
    logprobs += [s.logprob for s in result.samples]
    return out, logprobs, blocks


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_mix_38_dynamic_context_gives_the_static_programs_tokens(
    kind: str, tiny_checkpoints: dict[str, Path]
) -> None:
    """Same frames through eager and static engines: identical tokens, logprobs equal to
    float32 rounding (attention sums fewer masked blocks); the eager programs gathered
    exactly the blocks covering their contexts, below the full row."""
    static = ReferenceDriver(_engine(tiny_checkpoints[kind], ExecutionOptions.static()))
    eager = ReferenceDriver(_engine(tiny_checkpoints[kind], ExecutionOptions.eager()))
    static_out, static_logprobs, static_blocks = _scenario(static)
    eager_out, eager_logprobs, eager_blocks = _scenario(eager)
    full = static.engine.geometry.blocks_per_row
    assert static_blocks == [full] * len(static_blocks)
    assert eager_out == static_out
    assert eager_logprobs == pytest.approx(static_logprobs, rel=1e-5, abs=1e-5)
    assert all(b <= full for b in eager_blocks)
    assert min(eager_blocks) == 1 and max(eager_blocks) < full
    # the last chunk of a 200-token prompt (positions 192..199) needs 13 blocks
    assert eager_blocks[3] == 13 and eager_blocks[0] == 1


def test_mix_15_dynamic_bound_keeps_inactive_rows_untouched(
    tiny_checkpoints: dict[str, Path]
) -> None:
    """A decode frame on a padded batch with a short bound mutates no other row."""
    driver = ReferenceDriver(_engine(tiny_checkpoints["llama"], ExecutionOptions.eager()))
    driver.prefill(PREFILL_64, 0, prompt_of(20, seed=1), chunk=64)
    driver.prefill(PREFILL_64, 5, prompt_of(200, seed=2), chunk=64)
    engine = driver.engine
    state, cache = engine.parts.state, engine.parts.cache
    before = {name: t.clone() for name, t in state.fields().items()}
    keys_before, values_before = cache.keys.clone(), cache.values.clone()
    driver.decode(DECODE[4], [0])
    assert engine.programs[DECODE[4]].context_blocks == 2  # type: ignore[attr-defined]
    untouched = [r for r in range(state.rows) if r != 0]
    for name, tensor in state.fields().items():
        assert torch.equal(tensor[untouched], before[name][untouched]), name
    written = set(driver.rows[0].pages)
    others = [p for p in range(engine.geometry.num_pages) if p not in written]
    assert torch.equal(cache.keys[:, others], keys_before[:, others])
    assert torch.equal(cache.values[:, others], values_before[:, others])


def test_context_blocks_are_the_covering_block_count() -> None:
    assert [context_blocks(e, page_size=16, blocks_per_row=32) for e in (0, 1, 16, 17, 33)] \
        == [1, 1, 1, 2, 3]
    assert context_blocks(16 * 17, page_size=16, blocks_per_row=32) == 17
    assert context_blocks(10_000, page_size=16, blocks_per_row=24) == 24


def test_graph_dimensions_take_covering_powers_of_two() -> None:
    assert [covering_power_of_two(n, 8) for n in (0, 1, 2, 3, 5, 9)] == [1, 1, 2, 4, 8, 8]
    for limit in (1, 2, 3, 8, 13):
        chosen = {covering_power_of_two(n, limit) for n in range(limit + 3)}
        assert set(power_of_two_buckets(limit)) == chosen


def test_greedy_shortcut_samples_what_the_full_pipeline_samples() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    logits[2, 7] = float("nan")
    params = dict(temperature=torch.zeros(6), top_p=torch.full((6,), 0.8),
                  top_k=torch.full((6,), 5, dtype=torch.int64),
                  seed=torch.arange(6, dtype=torch.int64), position=torch.arange(6) + 4)
    full = sample(logits, **params)
    short = sample(logits, **params, greedy_only=True)
    for a, b in zip(full, short, strict=True):
        assert torch.equal(a, b)


def test_execution_options_default_by_device_and_refuse_host_bounds_on_cuda(
    tiny_checkpoints: dict[str, Path]
) -> None:
    """CUDA programs stay static (capturable); the CPU default follows the frame."""
    assert ExecutionOptions.for_device("cuda") == ExecutionOptions.static()
    assert ExecutionOptions.for_device("cuda:1").host_bounds is False
    assert ExecutionOptions.for_device("cpu") == ExecutionOptions.eager()
    engine = ModelEngine.load(tiny_checkpoints["llama"], device="cpu", dtype=None,
                              catalog=CATALOG, page_size=PAGE_SIZE, num_pages=64, state_rows=4)
    assert engine.execution.dynamic_context and engine.execution.greedy_shortcut
    with pytest.raises(ValueError, match="captured"):
        ModelEngine.load(tiny_checkpoints["llama"], device="cuda", dtype=None, catalog=CATALOG,
                         page_size=PAGE_SIZE, num_pages=64, state_rows=4,
                         execution=ExecutionOptions(dynamic_context=True))
