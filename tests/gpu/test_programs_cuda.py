"""On a CUDA device, every prepared program is capturable: replaying captured
``execute`` calls (torch CUDA graphs, largest first, one pool) gives the same tokens
as eager execution in bf16 and fp16, and bf16 greedy tracks transformers' float32
``generate``. Skipped without a device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import CATALOG, DECODE, MIXED_4, PAGE_SIZE, PREFILL_64, HFReference, prompt_of

from gpu.engine import ModelEngine
from gpu.frames import NO_PROMPT_ROW
from gpu.program import PreparedProgram
from gpu.programs.driver import ReferenceDriver
from policy.descriptors import GraphShape

pytestmark = pytest.mark.cuda


class _Captured:
    """A program whose ``execute`` replays a CUDA graph captured once."""

    def __init__(self, program: PreparedProgram, pool: object) -> None:
        self.inner = program
        self.shape = program.shape
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            program.execute()  # warm-up before any bind: touches only the sink
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            program.execute()

    def bind(self, inputs: object) -> None:
        self.inner.bind(inputs)  # type: ignore[arg-type]

    def execute(self) -> None:
        self.graph.replay()

    def read_outputs(self) -> dict[str, object]:
        return self.inner.read_outputs()


def _engine(model_dir: Path, dtype: str) -> ModelEngine:
    return ModelEngine.load(model_dir, device="cuda", dtype=dtype, catalog=CATALOG,
                            page_size=PAGE_SIZE, num_pages=64, state_rows=8)


def _run(model_dir: Path, dtype: str, capture: bool) -> list[list[int]]:
    engine = _engine(model_dir, dtype)
    if capture:
        pool = torch.cuda.graph_pool_handle()
        shapes: list[GraphShape] = sorted(engine.programs, key=lambda s: -s.max_packed_extent)
        engine.programs = {s: _Captured(engine.programs[s], pool) for s in shapes}  # type: ignore[misc]
    driver = ReferenceDriver(engine)
    out = {0: [driver.prefill(PREFILL_64, 0, prompt_of(70, 1), chunk=30)]}
    for _ in range(4):
        out[0] += driver.decode(DECODE[4], [0])
    result = driver.mixed(MIXED_4, (0, 3), prefill_row=1, prompt=prompt_of(40, 2),
                          prompt_ends=True)
    for s in result.samples:
        out.setdefault(s.row, []).append(s.token)
    for _ in range(6):
        result = driver.mixed(MIXED_4, (3, 0), prefill_row=NO_PROMPT_ROW)
        for s in result.samples:
            out[s.row].append(s.token)
    return [out[0], out[3]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_captured_programs_replay_like_eager(
    dtype: str, tiny_checkpoints: dict[str, Path]
) -> None:
    for kind in ("llama", "qwen3"):
        assert _run(tiny_checkpoints[kind], dtype, True) == _run(tiny_checkpoints[kind], dtype,
                                                                 False)


def test_cuda_bf16_decode_tracks_transformers(
    tiny_checkpoints: dict[str, Path], hf_reference: HFReference
) -> None:
    """bf16 greedy agrees with the float32 reference on most tokens (not bitwise)."""
    prompt = prompt_of(70, 1)
    expected = hf_reference.greedy("llama", prompt, 5)
    got = _run(tiny_checkpoints["llama"], "bfloat16", True)[0][:5]
    assert sum(a == b for a, b in zip(got, expected, strict=True)) >= 3
