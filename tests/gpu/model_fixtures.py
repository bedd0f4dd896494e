"""Shapes and engine construction shared by the gpu model/program tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpu.engine import ModelEngine
from policy.descriptors import GraphKind, GraphShape, StateOp

PREFILL_64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
PREFILL_128 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=128)
SCORED_64 = GraphShape(kind=GraphKind.SCORED_PREFILL, batch_capacity=1, token_capacity=64)
DECODE = {b: GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1)
          for b in (1, 2, 4, 8)}
MIXED_2 = GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=1,
                     prefill_capacity=64, packed_capacity=65)
MIXED_4 = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=1,
                     prefill_capacity=64, packed_capacity=67)
SNAPSHOT = GraphShape(kind=GraphKind.STATE, batch_capacity=2, token_capacity=0,
                      state_op=StateOp.SNAPSHOT)
RESTORE = GraphShape(kind=GraphKind.STATE, batch_capacity=2, token_capacity=0,
                     state_op=StateOp.RESTORE)
PAGE_COPY = GraphShape(kind=GraphKind.STATE, batch_capacity=4, token_capacity=0,
                       state_op=StateOp.PAGE_COPY)
INITIALIZE = GraphShape(kind=GraphKind.STATE, batch_capacity=4, token_capacity=0,
                        state_op=StateOp.INITIALIZE)

CATALOG = (PREFILL_64, PREFILL_128, SCORED_64, *DECODE.values(), MIXED_2, MIXED_4,
           SNAPSHOT, RESTORE, PAGE_COPY, INITIALIZE)

PAGE_SIZE = 16


def build_engine(model_dir: Path, *, state_rows: int = 8, num_pages: int = 64) -> ModelEngine:
    return ModelEngine.load(
        model_dir, device="cpu", dtype=None, catalog=CATALOG, page_size=PAGE_SIZE,
        num_pages=num_pages, state_rows=state_rows,
    )


def prompt_of(length: int, seed: int, vocab: int = 96) -> list[int]:
    """A deterministic prompt of token ids 3..vocab-1."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=length)]
