"""Host-input staging of the packed step programs: one input block, one upload.

Covers VER-18 (exactly one host-input upload per frame: every per-frame input is a view
of one contiguous block that ``bind`` fills with a single copy), MIX-38 (3) (the views
are allocated once and keep their addresses across binds and program variants),
VER-20 (a frame rejected while staging writes nothing, and on the CPU backend it fails
only its own launch, as a ``bind`` fault), and the staging contract the CPU backend
relies on: a frame staged while another is staged but not yet bound is independent of
it, and staged-then-bound inputs equal directly bound ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import DECODE, MIXED_4, PAGE_SIZE, PREFILL_64, build_engine, prompt_of

from gpu.backends.cpu import CpuBackend
from gpu.backends.protocol import ProgramFault
from gpu.engine import ModelEngine
from gpu.frames import (
    DecodeFrame,
    FrameError,
    MixedFrame,
    PageAppend,
    PrefillFrame,
    RowInit,
    as_inputs,
    result_of,
)
from gpu.programs.step import StepProgram
from gpu.programs.workspace import PackedBuffers

_INPUTS = ("host_token", "host_position", "from_state", "lane_offset", "token_lane", "valid",
           "next_token", "lane_rows", "sample_index", "commits_token", "absolute_position",
           "advance", "prompt_slots", "prompt_lane", "decode_slots")


@pytest.fixture
def engine(tiny_checkpoints: dict[str, Path]) -> ModelEngine:
    return build_engine(tiny_checkpoints["qwen3"])


def _step(engine: ModelEngine, shape: object) -> StepProgram:
    program = engine.programs[shape]  # type: ignore[index]
    assert isinstance(program, StepProgram)
    return program


def _inputs_of(buffers: PackedBuffers) -> dict[str, list[object]]:
    return {name: getattr(buffers, name).tolist() for name in _INPUTS}


def _prefill(row: int, length: int, page: int) -> PrefillFrame:
    """A whole prompt in one chunk, on fresh pages ``page, page+1, ...``."""
    pages = tuple(range(page, page + -(-length // PAGE_SIZE)))
    return PrefillFrame(row=row, tokens=tuple(prompt_of(length, seed=row)), start_position=0,
                        ends_prompt=True,
                        updates=(RowInit(row=row),
                                 PageAppend(row=row, first_block=0, page_ids=pages)))


def test_ver_18_mix_38_inputs_are_views_of_one_block_with_fixed_addresses(
    engine: ModelEngine,
) -> None:
    workspace = engine.parts.workspace
    block = workspace.inputs
    start, end = block.data_ptr(), block.data_ptr() + block.numel()
    programs = [_step(engine, s) for s in (PREFILL_64, DECODE[8], MIXED_4)]
    before = {}
    for program in programs:
        for name in _INPUTS:
            view = getattr(program.buffers, name)
            if not view.numel():  # decode programs have no prompt slots
                continue
            assert view.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
            assert start <= view.data_ptr() < end
            before[(id(program), name)] = view.data_ptr()
    programs[0].bind(as_inputs(_prefill(0, 12, page=3)))
    programs[1].bind(as_inputs(DecodeFrame(rows=(0,))))
    for program in programs:
        for (key, name), address in before.items():
            if key == id(program):
                assert getattr(program.buffers, name).data_ptr() == address


def test_ver_18_one_upload_per_bound_frame(
    engine: ModelEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = engine.parts.workspace
    uploads: list[int] = []
    upload = workspace.upload
    monkeypatch.setattr(workspace, "upload", lambda block: (uploads.append(1), upload(block)))
    prefill, decode = _step(engine, PREFILL_64), _step(engine, DECODE[8])
    prefill.bind(as_inputs(_prefill(0, 12, page=3)))
    assert len(uploads) == 1
    decode.bind(as_inputs(DecodeFrame(rows=(0,))))
    assert len(uploads) == 2


def test_staged_frames_are_independent_until_bound(engine: ModelEngine) -> None:
    """Two frames staged back to back (as at launch, while earlier frames run) each
    bind their own layout; a staged frame touches no program input before its bind."""
    prefill, mixed = _step(engine, PREFILL_64), _step(engine, MIXED_4)
    prefill.bind(as_inputs(_prefill(0, 20, page=3)))
    prefill.bind(as_inputs(_prefill(1, 30, page=10)))
    bound = _inputs_of(prefill.buffers)
    first = mixed.stage(as_inputs(MixedFrame(
        rows=(0, 5, 1), prefill_row=1, prompt_tokens=tuple(prompt_of(9, seed=5)),
        updates=(RowInit(row=5), PageAppend(row=5, first_block=0, page_ids=(20,))))))
    second = mixed.stage(as_inputs(MixedFrame(rows=(1, 0), prefill_row=-1)))
    assert _inputs_of(prefill.buffers) == bound  # staging wrote no program input
    mixed.bind_staged(first)
    staged_first = _inputs_of(mixed.buffers)
    mixed.bind_staged(second)
    staged_second = _inputs_of(mixed.buffers)

    direct = _step(engine, MIXED_4)
    direct.bind(as_inputs(MixedFrame(
        rows=(0, 5, 1), prefill_row=1, prompt_tokens=tuple(prompt_of(9, seed=5)))))
    assert _inputs_of(direct.buffers) == staged_first
    assert staged_first["lane_rows"][:3] == [0, 5, 1]
    assert staged_second["lane_rows"][:2] == [1, 0]
    assert staged_second["from_state"][:2] == [True, True]
    assert not any(staged_second["valid"][2:])


def test_ver_20_a_frame_rejected_while_staging_writes_nothing(engine: ModelEngine) -> None:
    mixed = _step(engine, MIXED_4)
    mixed.bind(as_inputs(MixedFrame(rows=(0, 1), prefill_row=-1)))
    state = {k: v.clone() for k, v in engine.parts.state.fields().items()}
    inputs = engine.parts.workspace.inputs.clone()
    bad = (
        MixedFrame(rows=(0, 0), prefill_row=-1),  # duplicate row
        MixedFrame(rows=(2,), prefill_row=-1,  # page outside the pool
                   updates=(PageAppend(row=2, first_block=0, page_ids=(10_000,)),)),
    )
    for frame in bad:
        with pytest.raises(FrameError):
            mixed.stage(as_inputs(frame))
        with pytest.raises(FrameError):
            mixed.bind(as_inputs(frame))
    assert torch.equal(engine.parts.workspace.inputs, inputs)
    for name, tensor in engine.parts.state.fields().items():
        assert torch.equal(tensor, state[name]), name


def test_bind_staged_refuses_a_frame_staged_for_another_program(engine: ModelEngine) -> None:
    staged = _step(engine, DECODE[4]).stage(as_inputs(DecodeFrame(rows=(0,))))
    with pytest.raises(FrameError, match="staged for"):
        _step(engine, DECODE[8]).bind_staged(staged)


def test_ver_20_cpu_backend_reports_a_staging_error_as_that_launchs_bind_fault(
    engine: ModelEngine,
) -> None:
    """The backend stages at launch; a rejected frame faults only its own launch (at
    ``bind``, as an unstaged bind would), and the launches around it complete."""
    prefill, decode = _step(engine, PREFILL_64), _step(engine, DECODE[8])
    with CpuBackend(num_threads=0) as backend:
        backend.prepare([prefill, decode])
        first = backend.launch(prefill, as_inputs(_prefill(0, 12, page=3)))
        bad = backend.launch(decode, as_inputs(DecodeFrame(rows=(0, 0))))
        after = backend.launch(decode, as_inputs(DecodeFrame(rows=(0,))))
        assert first.wait(60) and bad.wait(60) and after.wait(60)
        with pytest.raises(ProgramFault) as fault:
            bad.result()
        assert fault.value.stage == "bind"
        assert isinstance(fault.value.cause, FrameError)
        assert result_of(first.result().outputs).samples[0].finite
        assert result_of(after.result().outputs).samples[0].row == 0
    assert int(engine.parts.state.position[0]) == 13
