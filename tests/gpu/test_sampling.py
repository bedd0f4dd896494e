"""Sampling: greedy, temperature, top-k, top-p, and counter-based per-request seeds.

The same (seed, position) gives the same draw whatever else is in the batch, so a
fixed-seed request samples the same tokens alone or among others, in any lane, on any
batch capacity (reproducible across batch compositions; SPEC-10 padding).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import DECODE, PREFILL_64, build_engine, prompt_of

from gpu.frames import GREEDY, SamplingParams
from gpu.programs.driver import ReferenceDriver
from gpu.sampling import counter_uniform, sample


def _sample(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0,
            seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    n = seeds.shape[0]
    return sample(
        logits.expand(n, -1), temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p), top_k=torch.full((n,), top_k, dtype=torch.int64),
        seed=seeds, position=positions,
    ).token


def test_counter_uniform_is_a_pure_function_in_the_open_interval() -> None:
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62], dtype=torch.int64)
    positions = torch.tensor([0, 5, 5, 1000], dtype=torch.int64)
    a = counter_uniform(seeds, positions, 1000)
    b = counter_uniform(seeds.flip(0), positions.flip(0), 1000).flip(0)
    assert torch.equal(a, b)  # row order (batch composition) does not matter
    assert (a > 0).all() and (a < 1).all()
    assert abs(float(a.mean()) - 0.5) < 0.02
    # different seeds, positions and columns decorrelate
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])
    assert float(torch.corrcoef(torch.stack([a[1], a[2]]))[0, 1]).__abs__() < 0.1


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 20000
    tokens = _sample(logits, temperature=1.0, seeds=torch.full((n,), 42),
                     positions=torch.arange(n))
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0], dim=0), atol=0.015)
    hot = _sample(logits, temperature=2.0, seeds=torch.full((n,), 42), positions=torch.arange(n))
    freq_hot = torch.bincount(hot, minlength=5).float() / n
    assert torch.allclose(freq_hot, torch.softmax(logits[0] / 2.0, dim=0), atol=0.015)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 2.8, -1.0]])
    n = 4000
    seeds, positions = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    top2 = _sample(logits, temperature=1.5, top_k=2, seeds=seeds, positions=positions)
    assert set(top2.tolist()) == {0, 1}
    # probabilities ~[0.36, 0.33, 0.02, 0.30, 0.01]: the 0.6 nucleus is {0, 1}
    nucleus = _sample(logits, temperature=1.0, top_p=0.6, seeds=seeds, positions=positions)
    assert set(nucleus.tolist()) == {0, 1}
    assert set(_sample(logits, temperature=1.0, top_k=1, seeds=seeds,
                       positions=positions).tolist()) == {0}
    assert set(_sample(logits, temperature=1.0, top_p=0.01, seeds=seeds,
                       positions=positions).tolist()) == {0}


def test_greedy_rows_take_the_argmax_and_report_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0], [float("nan"), 0.0, 1.0]])
    token, logprob, finite, _, _ = sample(
        logits, temperature=torch.zeros(2), top_p=torch.ones(2),
        top_k=torch.zeros(2, dtype=torch.int64), seed=torch.zeros(2, dtype=torch.int64),
        position=torch.zeros(2, dtype=torch.int64),
    )
    assert token.tolist()[0] == 1
    assert logprob[0] == pytest.approx(float(torch.log_softmax(logits[0], 0)[1]))
    assert finite.tolist() == [True, False]


def test_fixed_seed_reproducible_across_batch_compositions(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """A seeded request samples the same stream alone on B=1 and in lane 2 of B=8 next
    to other sampled and greedy requests; a different seed gives a different stream."""
    prompt = prompt_of(23, seed=77)
    seeded = SamplingParams(temperature=1.3, top_p=0.95, top_k=40, seed=2024)

    def stream(rows_and_params: dict[int, SamplingParams], target: int, capacity: int) -> list[int]:
        driver = ReferenceDriver(build_engine(tiny_checkpoints["llama"]))
        for row, params in rows_and_params.items():
            p = prompt if row == target else prompt_of(11 + row, seed=row)
            driver.prefill(PREFILL_64, row, p, chunk=64, sampling=params)
        out = [int(driver.engine.parts.state.pending_token[target])]
        rows = list(rows_and_params)
        for _ in range(12):
            out.append(driver.decode(DECODE[capacity], rows)[rows.index(target)])
        return out

    alone = stream({0: seeded}, 0, 1)
    crowded = stream({3: SamplingParams(temperature=0.9, seed=1), 1: GREEDY,
                      5: seeded, 6: SamplingParams(temperature=2.0, seed=99)}, 5, 8)
    assert alone == crowded
    other = stream({0: SamplingParams(temperature=1.3, top_p=0.95, top_k=40, seed=2025)}, 0, 1)
    assert other != alone
