"""Sampled output through the whole runtime follows the target distribution.

The requirement "sampled output follows the target distribution: a statistical test on
the tiny model at temperature 1 that would catch a biased verifier", here end to end:
``actors.system.open_runtime`` on the CPU backend with a tiny random Llama pair (a
six-token vocabulary; the draft is a different, more peaked model), fixed-width
speculation at depth one so that every decode step is a complete speculative round
(MIX-7, LRN-10). Many requests share one prompt and sample at temperature 1 with their
own seeds. The first output token comes from the prefill's sampler; the second is the
first speculative position: the draft proposes it and the round's rejection sampling
accepts the draft or resamples from the residual. The empirical law of (first, second)
token is compared with the target's exact law (transformers, float64) by a chi-square
test at a fixed seed set, so the outcome is deterministic. The same test run with an
always-accept verifier (every acceptance uniform 0, so every draft the target gives
any mass passes) must reject, which shows it has power.

Covers SPEC-18, SPEC-19, SPEC-21, ACC-27 (rounds verified, survival reported) and the
sampled-distribution requirement at the runtime level; the kernel- and
program-level counterparts are in ``tests/gpu/test_speculative_verification.py`` and
``tests/gpu/test_speculative_program_sampling.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from actors.config import RuntimeConfig
from actors.public import GenerationRequest, SamplingParams, TokenDelta
from actors.system import open_runtime

VOCAB = 6
EOS = 2
PROMPT = (3, 4, 5, 3, 3, 4, 5, 5)
REQUESTS = 160
CLIENTS = 64
"""Requests in flight at once (more would only wait in the admission queue)."""


def _config(seed: int, hidden: int, layers: int, init: float) -> object:
    import transformers as tf

    torch.manual_seed(seed)
    return tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, initializer_range=init, bos_token_id=1, eos_token_id=EOS,
        rope_theta=10000.0, tie_word_embeddings=True,
    )


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A flat target (every (first, second) cell has expected count >= 2 here) and a
    peaked draft far from it (total variation about 0.7 on the second token)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("spec_distribution")
    dirs = []
    for name, seed, hidden, layers, init in (("target", 7, 32, 2, 0.1), ("draft", 8, 16, 1, 0.8)):
        directory = root / name
        tf.LlamaForCausalLM(_config(seed, hidden, layers, init)).eval().save_pretrained(directory)
        _write_tokenizer(directory)
        dirs.append(directory)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def target_law(pair: tuple[Path, Path]) -> np.ndarray:
    """P(first, second | prompt) under the target at temperature 1."""
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(pair[0]).eval()
    law = np.zeros((VOCAB, VOCAB))
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1].double(), dim=-1)
        for t1 in range(VOCAB):
            second = torch.softmax(
                model(torch.tensor([[*PROMPT, t1]])).logits[0, -1].double(), dim=-1)
            law[t1] = first[t1].item() * second.numpy()
    return law


async def _first_two_tokens(pair: tuple[Path, Path], *, device_process: bool = True
                            ) -> tuple[np.ndarray, int, int]:
    """Counts of (first, second) output token over ``REQUESTS`` seeded requests, the
    drafts the runtime verified and the drafts it accepted."""
    config = RuntimeConfig(
        device_process=device_process,
        model_dir=pair[0], draft_model_dir=pair[1], backend="cpu", max_batch=8,
        prefill_capacities=(64,), page_size=16, max_context=64, max_queue=CLIENTS,
        speculation="fixed", draft_source="draft", draft_depth=1)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    limiter = trio.Semaphore(CLIENTS)
    async with open_runtime(config) as rt:

        async def client(seed: int) -> None:
            tokens: list[int] = []
            request = GenerationRequest(
                prompt_token_ids=PROMPT, max_tokens=3, ignore_eos=True,
                sampling=SamplingParams(temperature=1.0, seed=seed))
            async with limiter, rt.generate(request) as events:
                async for event in events:
                    if isinstance(event, TokenDelta):
                        tokens.extend(event.token_ids)
            counts[tokens[0], tokens[1]] += 1

        async with trio.open_nursery() as nursery:
            for seed in range(REQUESTS):
                nursery.start_soon(client, 1000 + seed)
        stats = rt.statistics()
    return counts, stats.speculative_drafted_tokens, stats.speculative_accepted_tokens


def chi_square(counts: np.ndarray, law: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled into
    one cell) and its 0.001 critical value (Wilson-Hilferty)."""
    expected = law.reshape(-1) * counts.sum()
    observed = counts.reshape(-1).astype(np.float64)
    big = expected >= 5
    exp = np.append(expected[big], expected[~big].sum())
    obs = np.append(observed[big], observed[~big].sum())
    keep = exp > 0
    statistic = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 3.0902
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic, critical


@pytest.mark.slow
async def test_sampled_output_through_the_runtime_follows_the_target_law(
        pair: tuple[Path, Path], target_law: np.ndarray) -> None:
    """Rejection sampling in the served rounds keeps the target's law of the first
    speculative position (and of the prefill's token before it)."""
    with trio.fail_after(120):
        counts, drafted, accepted = await _first_two_tokens(pair)
    assert counts.sum() == REQUESTS
    assert drafted >= REQUESTS and 0 < accepted < drafted  # drafts were really verified
    statistic, critical = chi_square(counts, target_law)
    print(f"chi-square {statistic:.1f} (critical {critical:.1f}), accepted {accepted}/{drafted}")
    assert statistic < critical, (statistic, critical)


@pytest.mark.slow
async def test_the_runtime_test_rejects_an_always_accept_verifier(
        pair: tuple[Path, Path], target_law: np.ndarray,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A verifier that accepts every draft the target gives any mass (acceptance
    uniforms all 0) lets the draft's law through: the same statistic rejects it. The
    patch is made in this process, so the programs run here too."""
    from gpu.speculative import verification

    def always_accept(seed: torch.Tensor, first_position: torch.Tensor, depth: int
                      ) -> torch.Tensor:
        return torch.zeros((seed.shape[0], depth), dtype=torch.float32, device=seed.device)

    monkeypatch.setattr(verification, "acceptance_uniforms", always_accept)
    with trio.fail_after(120):
        counts, drafted, accepted = await _first_two_tokens(pair, device_process=False)
    assert accepted == drafted > 0
    statistic, critical = chi_square(counts, target_law)
    print(f"always-accept chi-square {statistic:.1f} (critical {critical:.1f})")
    assert statistic > critical, (statistic, critical)
