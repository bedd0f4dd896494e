"""On a CUDA device, complete speculative programs are capturable (CAT-10): replaying
each program's captured ``execute`` (torch CUDA graphs, largest first, one pool) gives
the same greedy and sampled tokens as eager execution, for both proposal sources and
both target bindings, and bf16 greedy speculation equals bf16 greedy decoding.
Skipped without a device.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from model_fixtures import DECODE, PREFILL_64, prompt_of
from speculative_driver import SpeculativeDriver

from gpu.engine import ModelEngine
from gpu.frames import SamplingParams
from gpu.program import PreparedProgram
from gpu.programs.driver import ReferenceDriver
from gpu.programs.speculative_attach import attach_speculation
from gpu.programs.speculative_binding import COPY, LEARNED
from policy.descriptors import GraphKind, GraphShape, TargetBinding

pytestmark = pytest.mark.cuda

SHAPES = (
    GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=1,
               proposal_depth=0, packed_capacity=2, binding=TargetBinding.QUERY_LENGTH),
    GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=4,
               proposal_depth=3, packed_capacity=8, binding=TargetBinding.QUERY_LENGTH),
    GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=4,
               proposal_depth=3, packed_capacity=5,
               binding=TargetBinding.SPECULATIVE_PREFIX_LIMIT),
)
MIXED_WIDE = GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=4,
                        proposal_depth=3, prefill_capacity=64, packed_capacity=68,
                        speculation_enabled=True)
GENERATE = 20


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


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tf
    from model_fixtures import _common

    torch.manual_seed(11)
    directory = tmp_path_factory.mktemp("cuda_draft")
    config = tf.LlamaConfig(**_common(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      tie_word_embeddings=True))
    tf.LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


def _engine(target: Path) -> ModelEngine:
    return ModelEngine.load(target, device="cuda", dtype="bfloat16",
                            catalog=(PREFILL_64, DECODE[2]), page_size=16, num_pages=64,
                            state_rows=4)


def _speculate(target: Path, draft: Path, source: str, capture: bool,
               sampling: SamplingParams) -> list[list[int]]:
    engine = _engine(target)
    attach_speculation(engine, (*SHAPES, MIXED_WIDE), source=source,
                       draft_model_dir=draft if source == LEARNED else None)
    if capture:
        pool = torch.cuda.graph_pool_handle()
        order = sorted(engine.programs, key=lambda s: -s.max_packed_extent)
        engine.programs = {s: _Captured(engine.programs[s], pool) for s in order}  # type: ignore[misc]
    driver = SpeculativeDriver(engine)
    prompts = [prompt_of(20, 1), prompt_of(8, 3) * 3]
    out = [[driver.prefill(PREFILL_64, r, p, chunk=64, sampling=sampling)]
           for r, p in enumerate(prompts)]
    for shape in itertools.cycle((*SHAPES, MIXED_WIDE)):
        if all(len(o) >= GENERATE for o in out):
            break
        if shape is MIXED_WIDE:
            lanes = driver.speculate_mixed(shape, [0, 1], [4, 2]).speculative.lanes
        else:
            limits = [shape.token_capacity, min(2, shape.token_capacity)]
            lanes = driver.speculate(shape, [0, 1], limits).lanes
        for lane in lanes:
            out[lane.row].extend(lane.tokens)
    return [o[:GENERATE] for o in out]


@pytest.mark.parametrize("source", [LEARNED, COPY])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_captured_speculative_programs_replay_like_eager(
    tiny_checkpoints: dict[str, Path], draft_dir: Path, source: str, temperature: float
) -> None:
    sampling = SamplingParams(temperature=temperature, seed=3)
    target = tiny_checkpoints["llama"]
    eager = _speculate(target, draft_dir, source, False, sampling)
    assert _speculate(target, draft_dir, source, True, sampling) == eager
    if temperature == 0.0:
        plain = ReferenceDriver(_engine(target))
        prompts = [prompt_of(20, 1), prompt_of(8, 3) * 3]
        for row, prompt in enumerate(prompts):
            tokens = [plain.prefill(PREFILL_64, row, prompt, chunk=64)]
            while len(tokens) < GENERATE:
                tokens += plain.decode(DECODE[2], [row])
            assert eager[row] == tokens
