"""Workload planning for the load benchmark: arrivals, lengths, clients, prompts.

Covers the load benchmark: Poisson and gamma arrivals deterministic for a seed with
the right mean rate, length distributions, weighted clients, tokenizer-built prompts and
the word-based fallback.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest

from ops.loadgen.prompts import TokenizerPrompts, WordPrompts, load_prompt_builder
from ops.loadgen.workload import (
    ClientSpec,
    LengthSpec,
    arrival_gaps,
    arrival_times,
    parse_clients,
    plan_requests,
    sample_lengths,
)


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_arrivals_are_deterministic_for_a_seed(kind: str) -> None:
    first = arrival_times(kind, 5.0, 100, np.random.default_rng(7), burstiness=0.5)  # type: ignore[arg-type]
    again = arrival_times(kind, 5.0, 100, np.random.default_rng(7), burstiness=0.5)  # type: ignore[arg-type]
    other = arrival_times(kind, 5.0, 100, np.random.default_rng(8), burstiness=0.5)  # type: ignore[arg-type]
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    assert np.all(np.diff(first) >= 0)


@pytest.mark.parametrize(
    ("kind", "burstiness", "cv2"),
    [("poisson", 1.0, 1.0), ("gamma", 0.25, 4.0), ("gamma", 4.0, 0.25)],
)
def test_arrivals_have_the_mean_rate_and_burstiness(
    kind: str, burstiness: float, cv2: float
) -> None:
    gaps = arrival_gaps(kind, 8.0, 40_000, np.random.default_rng(1), burstiness)  # type: ignore[arg-type]
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.03)
    # Squared coefficient of variation of the gaps: 1 / shape (1 for Poisson).
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(cv2, rel=0.1)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused() -> None:
    assert np.array_equal(
        arrival_times("poisson", math.inf, 4, np.random.default_rng(0)), np.zeros(4)
    )
    with pytest.raises(ValueError, match="rate"):
        arrival_gaps("poisson", 0.0, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="burstiness"):
        arrival_gaps("gamma", 1.0, 3, np.random.default_rng(0), burstiness=0.0)


def test_length_distributions() -> None:
    rng = np.random.default_rng(3)
    fixed = sample_lengths(LengthSpec(kind="fixed", prompt_tokens=7, output_tokens=9), 5, rng)
    assert fixed.tolist() == [[7, 9]] * 5
    uniform = sample_lengths(
        LengthSpec(kind="uniform", prompt_min=3, prompt_max=5, output_min=10, output_max=10),
        2000,
        rng,
    )
    assert set(uniform[:, 0].tolist()) == {3, 4, 5}
    assert set(uniform[:, 1].tolist()) == {10}
    mix = sample_lengths(
        LengthSpec(
            kind="sharegpt", prompt_min=1, prompt_max=100_000, output_min=1, output_max=100_000
        ),
        20_000,
        rng,
    )
    assert np.median(mix[:, 0]) == pytest.approx(120, rel=0.05)
    assert np.median(mix[:, 1]) == pytest.approx(180, rel=0.05)
    assert mix[:, 0].mean() > 1.4 * np.median(mix[:, 0])  # heavy right tail
    clipped = sample_lengths(
        LengthSpec(kind="sharegpt", prompt_min=16, prompt_max=64, output_min=8, output_max=32),
        2000,
        rng,
    )
    assert clipped[:, 0].min() == 16 and clipped[:, 0].max() == 64
    assert clipped[:, 1].min() >= 8 and clipped[:, 1].max() == 32


def test_clients_parse_and_reject_bad_specs() -> None:
    assert parse_clients("alice:3, bob") == (
        ClientSpec(name="alice", weight=3.0),
        ClientSpec(name="bob", weight=1.0),
    )
    for bad in ("", "a:0", "a:-1", "a,a", ":2"):
        with pytest.raises(ValueError):
            parse_clients(bad)


def test_plan_follows_client_weights_and_is_ordered_and_deterministic() -> None:
    kwargs = dict(
        count=4000,
        rate=20.0,
        arrivals="poisson",
        lengths=LengthSpec(),
        clients=parse_clients("heavy:3,light:1"),
        seed=11,
    )
    plans = plan_requests(**kwargs)  # type: ignore[arg-type]
    assert plans == plan_requests(**kwargs)  # type: ignore[arg-type]
    assert [p.index for p in plans] == list(range(4000))
    times = [p.arrival_s for p in plans]
    assert times == sorted(times)
    heavy = sum(p.client == "heavy" for p in plans) / len(plans)
    assert heavy == pytest.approx(0.75, abs=0.03)
    assert len(plans) / times[-1] == pytest.approx(20.0, rel=0.06)


def test_all_at_once_plan_interleaves_clients_by_weight() -> None:
    plans = plan_requests(
        count=8,
        rate=math.inf,
        arrivals="poisson",
        lengths=LengthSpec(),
        clients=parse_clients("a:3,b:1"),
        seed=0,
    )
    assert [p.client for p in plans].count("a") == 6
    assert all(p.arrival_s == 0.0 for p in plans)


def test_word_prompts_have_one_word_per_target_token() -> None:
    builder = WordPrompts()
    text = builder.build(25, np.random.default_rng(0))
    assert builder.count_tokens(text) == 25
    assert text != builder.build(25, np.random.default_rng(1))


def test_missing_tokenizer_falls_back_with_a_message(tmp_path: pathlib.Path) -> None:
    builder, message = load_prompt_builder(tmp_path)
    assert isinstance(builder, WordPrompts)
    assert message is not None and "tokenizer.json" in message


def test_tokenizer_prompts_hit_the_target_length(tmp_path: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [WordPrompts().build(200, np.random.default_rng(i)) for i in range(20)]
    tokenizer.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    builder, message = load_prompt_builder(tmp_path)
    assert message is None and isinstance(builder, TokenizerPrompts)
    for target in (1, 17, 120):
        text = builder.build(target, np.random.default_rng(target))
        assert abs(builder.count_tokens(text) - target) <= 1
    assert builder.count_tokens("") == 0
