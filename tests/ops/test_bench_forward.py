"""``flare bench forward`` compares each program with the same work in plain torch: the
plain forward must choose the program's greedy tokens, or the ratio means nothing."""

from __future__ import annotations

import torch

from actors.config import DEFAULT_MODEL_DIR
from gpu.frames import RESULT_KEY
from ops.bench_forward import load_pairs


def test_plain_forward_picks_the_programs_greedy_tokens() -> None:
    pairs = load_pairs(DEFAULT_MODEL_DIR, batches=(1, 4), capacities=(64,), context=40,
                       max_context=128, page_size=16, capture=False)
    assert sorted(p.shape.label() for p in pairs) == [
        "decode[B=1]", "decode[B=4]", "prefill[C=64]"]
    with torch.inference_mode():
        for pair in pairs:
            pair.program.bind(pair.frame)
            pair.program.execute()
            flare = pair.program.read_outputs()[RESULT_KEY].tokens.tolist()
            plain = pair.plain.step(pair.tokens, pair.start).tolist()
            assert flare == plain, pair.shape.label()
