"""Session fixtures for the gpu model/program tests: tiny random HF checkpoints
(Llama, Qwen2, Qwen3) saved locally with transformers ``save_pretrained`` (no hub
access) and transformers as the reference peer. Builders live in ``model_fixtures``
(a uniquely named module: several test directories have a ``conftest``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_fixtures import MODEL_KINDS, HFReference, build_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _single_intra_op_thread() -> object:
    """Tiny models on a shared 2-core machine: intra-op threads only add contention
    (about 10x slower here); restored after each module."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Directory of each tiny checkpoint, by kind."""
    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for kind in MODEL_KINDS:
        directory = root / kind
        directory.mkdir()
        out[kind] = build_checkpoint(kind, directory)
    return out


@pytest.fixture(scope="session")
def hf_reference(tiny_checkpoints: dict[str, Path]) -> HFReference:
    return HFReference(tiny_checkpoints)
