"""Sampled output of the complete speculative program follows the target's law.

A tiny random Llama target and a different, smaller draft share a four-token
vocabulary. Every request starts from the same cached 16-token prompt (its pages are
shared read-only) with the same pending token, samples at temperature 1 with its own
seed, and runs complete rounds until it has three new tokens. The empirical law of
those three tokens is compared with the target's exact law (computed with
transformers) by a chi-square test at a fixed seed set; the same counts must be far
from the draft's law, which shows the test would notice a verifier that lets draft
tokens through. Covers "sampled output follows the target distribution"
end to end, for host query lengths and device allocation with the learned draft, and
for copy proposals (point masses from the request's history).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from logit_reference import reference_logits

from gpu.engine import ModelEngine
from gpu.frames import FRAME_KEY, PageAppend, RowInit, SamplingParams
from gpu.programs.driver import ReferenceDriver
from gpu.programs.speculative_attach import attach_speculation
from gpu.programs.speculative_binding import COPY, LEARNED
from gpu.programs.speculative_frames import SpeculativeFrame, speculative_result_of
from policy.descriptors import GraphKind, GraphShape, TargetBinding

VOCAB, PAGE, LANES, WIDTH, NEW = 4, 16, 16, 3, 3
PENDING = 3
REQUESTS = 1600
PREFILL = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
HOST = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=LANES, token_capacity=WIDTH,
                  proposal_depth=WIDTH - 1, packed_capacity=LANES * WIDTH,
                  binding=TargetBinding.QUERY_LENGTH)
DEVICE = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=LANES, token_capacity=WIDTH,
                    proposal_depth=WIDTH - 1, packed_capacity=LANES + 10,
                    binding=TargetBinding.SPECULATIVE_PREFIX_LIMIT)
PROMPT = [1, 0, 2, 3, 3, 1, 0, 0, 2, 1, 3, 2, 0, 1, 1, 2]


def _config(seed: int, hidden: int, layers: int) -> object:
    import transformers as tf

    torch.manual_seed(seed)
    return tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, initializer_range=0.12, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import transformers as tf

    root = tmp_path_factory.mktemp("spec_sampling")
    dirs = []
    for name, seed, hidden, layers in (("target", 7, 32, 2), ("draft", 8, 16, 1)):
        model = tf.LlamaForCausalLM(_config(seed, hidden, layers)).eval()
        model.save_pretrained(root / name)
        dirs.append(root / name)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def laws(small_pair: tuple[Path, Path]) -> tuple[np.ndarray, np.ndarray]:
    return exact_law(small_pair[0]), exact_law(small_pair[1])


def exact_law(model_dir: Path, processing: SamplingParams | None = None) -> np.ndarray:
    """P(t1, t2, t3 | prompt, pending) under ``model_dir`` at temperature 1, with
    ``processing``'s penalties, bias and min-p filter when given (the reference's, over
    the outputs before each token)."""
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(model_dir).eval()
    law = np.zeros((VOCAB,) * NEW)
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=NEW - 1):
            ids = torch.tensor([[*PROMPT, PENDING, *prefix]])
            logits = model(ids).logits[0].double()
            probs = torch.softmax(logits, dim=-1)
            if processing is not None:
                probs = torch.stack([_processed_probs(logits[k - NEW], processing,
                                                      list(prefix[:k]))
                                     for k in range(NEW)])
            for t3 in range(VOCAB):
                law[(*prefix, t3)] = (probs[-3, prefix[0]] * probs[-2, prefix[1]]
                                      * probs[-1, t3]).item()
    return law


def _processed_probs(logits: torch.Tensor, s: SamplingParams, outputs: list[int]
                     ) -> torch.Tensor:
    processed = torch.tensor(reference_logits(logits.tolist(), s, prompt=[], outputs=outputs,
                                              ends=set()), dtype=torch.float64)
    probs = torch.softmax(processed, dim=-1)
    probs = torch.where(probs >= s.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def sample_counts(target: Path, draft: Path, shape: GraphShape, source: str,
                  processing: SamplingParams | None = None) -> tuple[np.ndarray, int]:
    """Counts of the first three new tokens over ``REQUESTS`` requests, and the drafts
    accepted on the way."""
    engine = ModelEngine.load(target, device="cpu", dtype=None, catalog=(PREFILL,),
                              page_size=PAGE, num_pages=LANES + 2, state_rows=LANES + 1,
                              require_tokenizer=False)
    attach_speculation(engine, (shape,), source=source,
                       draft_model_dir=draft if source == LEARNED else None)
    driver = ReferenceDriver(engine)
    prompt_row = LANES
    driver.prefill(PREFILL, prompt_row, PROMPT, chunk=64)  # target and draft KV, page 0
    shared = driver.rows[prompt_row].pages[0]
    own = [p for p in range(LANES + 2) if p != shared][:LANES]
    program = engine.programs[shape]
    counts = np.zeros((VOCAB,) * NEW, dtype=np.int64)
    accepted = 0
    rows = tuple(range(LANES))
    for batch in range(REQUESTS // LANES):
        updates: tuple[RowInit | PageAppend, ...] = ()
        for row in rows:
            sampling = replace(processing or SamplingParams(), temperature=1.0,
                               seed=10_000 + batch * LANES + row)
            updates += (RowInit(row=row, position=PAGE, pending_token=PENDING, sampling=sampling),
                        PageAppend(row=row, first_block=0, page_ids=(shared, own[row])))
        produced: list[list[int]] = [[] for _ in rows]
        for round_index in itertools.count():
            limits = tuple(1 + (row + round_index) % WIDTH for row in rows) \
                if shape is HOST else (WIDTH,) * LANES
            program.bind({FRAME_KEY: SpeculativeFrame(rows=rows, limits=limits,
                                                      updates=updates)})
            updates = ()
            program.execute()
            for lane in speculative_result_of(program.read_outputs()).lanes:
                produced[lane.row].extend(lane.tokens)
                accepted += lane.accepted
            if min(len(p) for p in produced) >= NEW:
                break
        for tokens in produced:
            counts[tuple(tokens[:NEW])] += 1
    return counts, accepted


def chi_square(counts: np.ndarray, law: np.ndarray) -> tuple[float, float]:
    """Statistic and the 0.001 critical value (Wilson-Hilferty) over cells with mass."""
    expected = law.reshape(-1) * counts.sum()
    observed = counts.reshape(-1)
    mask = expected > 0
    statistic = float((((observed - expected) ** 2)[mask] / expected[mask]).sum())
    dof = int(mask.sum()) - 1
    z = 3.0902
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic, critical


EVERY_ROUND_KIND = pytest.mark.parametrize(
    ("shape", "source"), [(HOST, LEARNED), (DEVICE, LEARNED), (HOST, COPY)],
    ids=["query_length", "prefix_limit", "copy"])


@pytest.mark.slow
@EVERY_ROUND_KIND
def test_sampled_output_follows_the_target_law(
    small_pair: tuple[Path, Path], laws: tuple[np.ndarray, np.ndarray], shape: GraphShape,
    source: str,
) -> None:
    target, draft = small_pair
    target_law, draft_law = laws
    counts, accepted = sample_counts(target, draft, shape, source)
    assert counts.sum() == REQUESTS
    assert accepted > REQUESTS // 10  # drafts were verified and accepted, not bypassed
    statistic, critical = chi_square(counts, target_law)
    assert statistic < critical, (statistic, critical)
    against_draft, _ = chi_square(counts, draft_law)
    print(f"chi-square {statistic:.1f} (critical {critical:.1f}), against the draft "
          f"{against_draft:.1f}")
    assert against_draft > 3 * critical, (against_draft, critical)


PROCESSING = SamplingParams(frequency_penalty=1.2, presence_penalty=0.6, min_p=0.15,
                            logit_bias=((0, 0.8), (3, -0.5)))


@pytest.mark.slow
@EVERY_ROUND_KIND
def test_sampled_output_with_processing_follows_the_processed_law(
    small_pair: tuple[Path, Path], laws: tuple[np.ndarray, np.ndarray], shape: GraphShape,
    source: str,
) -> None:
    """Penalties, logit bias and min-p: each target row of a round is processed as after
    the drafts before it, so sampled output follows the processed target law (and not
    the unprocessed one)."""
    target, draft = small_pair
    processed_law = exact_law(target, PROCESSING)
    counts, accepted = sample_counts(target, draft, shape, source, PROCESSING)
    assert accepted > REQUESTS // 20  # penalties make copies of the history rarer
    statistic, critical = chi_square(counts, processed_law)
    assert statistic < critical, (statistic, critical)
    unprocessed, _ = chi_square(counts, laws[0])
    assert unprocessed > 3 * critical, (unprocessed, critical)
