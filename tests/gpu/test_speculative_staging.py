"""Host-input staging of complete speculative programs: one input block, one upload.

Covers VER-18 (one host-input upload per speculative frame: lane rows, limits and a
mixed frame's prompt chunk are views of one program-owned block that ``bind_staged``
fills with a single copy), MIX-38 (3) (the views keep their addresses across binds, so
captured programs read the same buffers), VER-20 (a frame rejected while staging
writes nothing), and the contract the CPU backend relies on: a staged frame is
independent of frames staged after it, and ``bind_staged`` on the CPU does no per-frame
tensor construction (only the state updates, the one copy and the host bounds). The
draft-maintaining wrappers of the step programs stage through their inner program.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from model_fixtures import DECODE, PREFILL_64, build_checkpoint

from gpu.backends.cpu import stage_launch
from gpu.backends.protocol import LaunchHandle
from gpu.draft_state import DraftMaintainingProgram
from gpu.engine import ModelEngine
from gpu.frames import FRAME_KEY, DecodeFrame, FrameError, PageAppend
from gpu.programs.speculative import SpeculativeProgram
from gpu.programs.speculative_attach import attach_speculation
from gpu.programs.speculative_binding import COPY, StagedRound
from gpu.programs.speculative_frames import SpeculativeFrame, SpeculativeMixedFrame
from gpu.programs.speculative_mixed import SpeculativeMixedProgram
from gpu.programs.step import StagedFrame
from policy.descriptors import GraphKind, GraphShape, TargetBinding

SPEC = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=3,
                  proposal_depth=2, packed_capacity=12, binding=TargetBinding.QUERY_LENGTH)
OTHER = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=2,
                   proposal_depth=1, packed_capacity=4, binding=TargetBinding.QUERY_LENGTH)
MIXED = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=3,
                   proposal_depth=2, prefill_capacity=64, packed_capacity=64 + 3 * 3,
                   speculation_enabled=True)
MIXED_INPUTS = ("prompt_row", "prompt_lane", "prompt_tokens", "prompt_positions",
                "prompt_valid", "prompt_ends", "prompt_end_position")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> ModelEngine:
    target = build_checkpoint("llama", tmp_path_factory.mktemp("spec_staging") / "target")
    loaded = ModelEngine.load(target, device="cpu", dtype=None,
                              catalog=(PREFILL_64, DECODE[1], DECODE[2]), page_size=16,
                              num_pages=32, state_rows=6, require_tokenizer=False)
    attach_speculation(loaded, (SPEC, OTHER, MIXED), source=COPY)
    return loaded


def _program(engine: ModelEngine, shape: GraphShape) -> Any:
    program = engine.programs[shape]
    assert isinstance(program, SpeculativeProgram)
    return program


def _inputs(program: SpeculativeProgram) -> dict[str, torch.Tensor]:
    names = ("lane_rows", "lane_limit") + (
        MIXED_INPUTS if isinstance(program, SpeculativeMixedProgram) else ())
    return {name: getattr(program, name) for name in names}


def _values(program: SpeculativeProgram) -> dict[str, list[Any]]:
    return {name: t.tolist() for name, t in _inputs(program).items()}


@contextmanager
def _no_tensor_construction() -> Iterator[None]:
    """Make every per-frame tensor constructor the old ``bind`` used fail."""
    saved = {name: getattr(torch, name) for name in ("tensor", "as_tensor", "arange")}

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("bind_staged built a tensor")

    try:
        for name in saved:
            setattr(torch, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


@pytest.mark.parametrize("shape", [SPEC, MIXED], ids=["speculative", "mixed"])
def test_ver_18_mix_38_inputs_are_views_of_one_block_with_fixed_addresses(
    engine: ModelEngine, shape: GraphShape
) -> None:
    program = _program(engine, shape)
    block = program.input_block.block
    start, end = block.data_ptr(), block.data_ptr() + block.numel()
    before = {name: t.data_ptr() for name, t in _inputs(program).items()}
    for name, ptr in before.items():
        assert start <= ptr < end, name
    frame: Any = (SpeculativeFrame(rows=(1, 0), limits=(2, 1)) if shape is SPEC else
                  SpeculativeMixedFrame(rows=(2, 0), limits=(0, 3), prefill_row=0,
                                        prompt_tokens=(5, 6, 7), prompt_start=4))
    program.bind({FRAME_KEY: frame})
    assert {name: t.data_ptr() for name, t in _inputs(program).items()} == before


def test_ver_18_bind_staged_is_one_upload_and_builds_no_tensor(
    engine: ModelEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = _program(engine, SPEC)
    uploads: list[np.ndarray] = []
    upload = program.input_block.upload
    monkeypatch.setattr(program.input_block, "upload",
                        lambda block: (uploads.append(block), upload(block)))
    staged = program.stage({FRAME_KEY: SpeculativeFrame(rows=(3, 1, 0), limits=(3, 1, 2))})
    assert isinstance(staged, StagedRound)
    with _no_tensor_construction():
        program.bind_staged(staged)
    assert len(uploads) == 1 and uploads[0] is staged.block
    sink = engine.parts.state.sink_row
    assert _values(program) == {"lane_rows": [3, 1, 0, sink], "lane_limit": [3, 1, 2, 0]}


def test_staged_frames_are_independent_until_bound(engine: ModelEngine) -> None:
    program = _program(engine, MIXED)
    sink = engine.parts.state.sink_row
    first = program.stage({FRAME_KEY: SpeculativeMixedFrame(
        rows=(4, 1, 2), limits=(2, 0, 3), prefill_row=1, prompt_tokens=(9, 8, 7, 6),
        prompt_start=32, prompt_ends=True)})
    second = program.stage({FRAME_KEY: SpeculativeMixedFrame(rows=(5,), limits=(1,))})
    program.bind_staged(first)
    chunk = MIXED.prefill_capacity
    positions = list(range(32, 32 + chunk))
    assert _values(program) == {
        "lane_rows": [4, 1, 2, sink], "lane_limit": [2, 0, 3, 0], "prompt_row": [1],
        "prompt_lane": [1], "prompt_tokens": [9, 8, 7, 6] + [0] * (chunk - 4),
        "prompt_positions": positions, "prompt_valid": [True] * 4 + [False] * (chunk - 4),
        "prompt_ends": [True], "prompt_end_position": [36]}
    assert program.context_blocks >= 36 // 16 + 1  # the chunk's end bounds the context
    program.bind_staged(second)
    assert _values(program) == {
        "lane_rows": [5, sink, sink, sink], "lane_limit": [1, 0, 0, 0],
        "prompt_row": [sink],
        "prompt_lane": [0], "prompt_tokens": [0] * chunk, "prompt_positions": list(range(chunk)),
        "prompt_valid": [False] * chunk, "prompt_ends": [False], "prompt_end_position": [0]}


@pytest.mark.parametrize("frame", [
    SpeculativeFrame(rows=(0, 1, 2, 3, 4), limits=(1,) * 5),
    SpeculativeFrame(rows=(0,), limits=(4,)),
    SpeculativeFrame(rows=(0,), limits=(1,), updates=(PageAppend(row=0, first_block=0, page_ids=(999,)),)),
], ids=["too-many-lanes", "limit-over-width", "bad-page"])
def test_ver_20_a_frame_rejected_while_staging_writes_nothing(
    engine: ModelEngine, frame: SpeculativeFrame
) -> None:
    program = _program(engine, SPEC)
    program.bind({FRAME_KEY: SpeculativeFrame(rows=(2,), limits=(1,))})
    inputs = program.input_block.block.clone()
    table = engine.parts.state.block_table.clone()
    with pytest.raises(FrameError):
        program.stage({FRAME_KEY: frame})
    assert torch.equal(program.input_block.block, inputs)
    assert torch.equal(engine.parts.state.block_table, table)


def test_bind_staged_refuses_a_frame_staged_for_another_program(engine: ModelEngine) -> None:
    staged = _program(engine, OTHER).stage(
        {FRAME_KEY: SpeculativeFrame(rows=(0,), limits=(1,))})
    with pytest.raises(FrameError, match="staged for"):
        _program(engine, SPEC).bind_staged(staged)


def test_cpu_backend_stages_speculative_and_draft_maintaining_launches(
    engine: ModelEngine,
) -> None:
    """Both kinds of program in a speculative load are staged at launch (the ordinary
    decode program is wrapped to keep the draft context; staging goes through it)."""
    decode = engine.programs[DECODE[1]]
    assert isinstance(decode, DraftMaintainingProgram)
    launches = {
        SPEC: (_program(engine, SPEC), SpeculativeFrame(rows=(0,), limits=(1,)), StagedRound),
        DECODE[1]: (decode, DecodeFrame(rows=(0,)), StagedFrame),
    }
    for shape, (program, frame, kind) in launches.items():
        launch = stage_launch(program, {FRAME_KEY: frame},
                              LaunchHandle(shape, sequence=0, launched_ns=0))
        assert launch.stage_error is None
        assert isinstance(launch.staged, kind)
