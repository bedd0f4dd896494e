"""The speculative building blocks are capturable: fixed shapes, no host sync, no
data-dependent shapes. On the CPU this runs the whole composition on the ``meta``
device (no data: any ``.item()``, ``nonzero`` or data-dependent shape would raise); on a
CUDA device it captures the composition in a CUDA graph and checks that replays on new
inputs equal eager runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu.speculative import (
    allocate_target_rows,
    append_context,
    confidence_sidecar,
    draft_confidence,
    filtered_probs_by_lane,
    packed_layout,
    propose_copy,
    sample_draft_tokens,
    unpack_lane_rows,
    verify_drafts,
)

BATCH, WIDTH, VOCAB, CONTEXT, ROWS = 4, 4, 11, 32, 9


def _inputs(device: str, generator_seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(generator_seed)
    i64 = torch.int64
    values = {
        "target_logits": torch.randn(BATCH, WIDTH, VOCAB, generator=gen) * 2,
        "draft_logits": torch.randn(BATCH, WIDTH - 1, VOCAB, generator=gen) * 2,
        "temperature": torch.tensor([0.0, 0.7, 1.0, 1.3]),
        "top_p": torch.tensor([1.0, 0.9, 1.0, 0.8]),
        "top_k": torch.tensor([0, 0, 5, 0], dtype=i64),
        "seed": torch.randint(0, 2**40, (BATCH,), generator=gen),
        "position": torch.randint(1, 20, (BATCH,), generator=gen),
        "ceilings": torch.tensor([4, 2, 0, 3], dtype=i64),
        "context": torch.randint(0, 3, (BATCH, CONTEXT), generator=gen),
        "context_length": torch.randint(1, CONTEXT - WIDTH, (BATCH,), generator=gen),
    }
    return {name: value.to(device) for name, value in values.items()}


def _compose(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One learned-draft round with device allocation, then a copy proposal."""
    sampling = dict(temperature=x["temperature"], top_p=x["top_p"], top_k=x["top_k"])
    q = filtered_probs_by_lane(x["draft_logits"], **sampling)
    p = filtered_probs_by_lane(x["target_logits"], **sampling)
    depth = WIDTH - 1
    offsets = torch.arange(1, WIDTH, device=q.device, dtype=torch.int64)[None, :]
    drafts = sample_draft_tokens(
        q.reshape(-1, VOCAB), x["seed"][:, None].expand(-1, depth).reshape(-1),
        (x["position"][:, None] + offsets).reshape(-1),
        x["position"][:, None].expand(-1, depth).reshape(-1),
    ).reshape(BATCH, depth)
    sidecar = confidence_sidecar(draft_confidence(q, drafts >= 0))
    lengths = allocate_target_rows(sidecar[1], x["ceilings"], ROWS)
    layout = packed_layout(lengths, ROWS)
    lane_rows = unpack_lane_rows(layout.row_depth, layout, WIDTH)
    verified = verify_drafts(draft_tokens=drafts, draft_probs=q, target_probs=p, lengths=lengths,
                             seed=x["seed"], position=x["position"] + 1)
    context, context_length = x["context"].clone(), x["context_length"].clone()
    append_context(context, context_length, verified.tokens, verified.emitted)
    copy = propose_copy(context, context_length, depth=depth, max_ngram=3)
    return {"sidecar": sidecar, "lengths": lengths, "lane_rows": lane_rows,
            "tokens": verified.tokens, "survival": verified.survival,
            "context": context, "copy": copy.tokens, "proposed": copy.proposed}


@pytest.mark.slow  # the first meta sort/cumprod imports torch's meta kernels (~5 s)
def test_the_composition_runs_without_data_on_the_meta_device() -> None:
    meta = {name: torch.empty(value.shape, dtype=value.dtype, device="meta")
            for name, value in _inputs("cpu", 0).items()}
    out = _compose(meta)
    assert out["sidecar"].shape == (2, BATCH, WIDTH - 1)
    assert out["tokens"].shape == (BATCH, WIDTH)
    assert out["copy"].shape == (BATCH, WIDTH - 1)


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager() -> None:
    static = _inputs("cuda", 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _compose(static)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs: dict[str, Any] = _compose(static)
    for generator_seed in (1, 2, 3):
        fresh = _inputs("cuda", generator_seed)
        for name, value in fresh.items():
            static[name].copy_(value)
        graph.replay()
        eager = _compose(fresh)
        for name, value in eager.items():
            assert torch.equal(outputs[name], value), name
