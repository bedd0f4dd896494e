"""The cpu backend running the engine's real programs: frames queued back to back.

Two decode frames launched without waiting run in stream order and read the state the
first one wrote (architecture: *Two frame slots, device-resident feedback*, OPEN-40),
giving exactly the tokens of the same frames run one at a time, on the device process
(whose state writes the host reads through the shared tensors) and on the in-process
stream alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu.backends import Completion, open_backend
from gpu.catalog import CatalogFlags, build_catalog
from gpu.engine import ModelEngine
from gpu.frames import DecodeFrame, PageAppend, PrefillFrame, RowInit, as_inputs, result_of
from policy.descriptors import GraphKind, GraphShape

PROMPT = (5, 17, 33, 8, 41, 12, 9)


def _run(model_dir: Path, *, queued: bool, completions: list[Completion] | None = None,
         **backend_options: object) -> tuple[list[tuple[int, ...]], list[int]]:
    """Two prefills then three decodes of both rows; ``completions`` collects the
    decodes' completions."""
    catalog = build_catalog(CatalogFlags(max_batch=2, prefill_capacities=(64,),
                                         scored_prefill=False, state_operations=False))
    backend = open_backend("cpu", **backend_options)
    try:
        engine = ModelEngine.load(model_dir, device="cpu", dtype=None, catalog=catalog.shapes,
                                  page_size=16, num_pages=16, state_rows=2, max_context=128)
        backend.prepare(list(engine.programs.values()))
        prefill = engine.programs[GraphShape(kind=GraphKind.PREFILL, batch_capacity=1,
                                             token_capacity=64)]
        decode = engine.programs[catalog.of_kind(GraphKind.DECODE)[-1]]
        for row in (0, 1):
            prompt = PROMPT[row:]
            frame = PrefillFrame(row=row, tokens=prompt, start_position=0, ends_prompt=True,
                                 updates=(RowInit(row=row),
                                          PageAppend(row=row, first_block=0,
                                                     page_ids=(4 * row, 4 * row + 1))))
            handle = backend.launch(prefill, as_inputs(frame))
            assert handle.wait(30)
            handle.result()
        frame = as_inputs(DecodeFrame(rows=(0, 1)))
        handles = []
        for _ in range(3):
            handles.append(backend.launch(decode, frame))
            if not queued:
                assert handles[-1].wait(30)
        steps = []
        for handle in handles:
            assert handle.wait(30)
            if completions is not None:
                completions.append(handle.result())
            result = result_of(handle.result().outputs)
            steps.append(tuple(s.token for s in result.samples))  # type: ignore[union-attr]
        positions = [int(engine.parts.state.position[row]) for row in (0, 1)]
        return steps, positions
    finally:
        backend.close()


@pytest.mark.parametrize("device_process", [True, False], ids=["device-process", "thread"])
def test_queued_decode_frames_read_device_state_in_stream_order(
    tiny_checkpoints: dict[str, Path], device_process: bool,
) -> None:
    sequential, seq_positions = _run(tiny_checkpoints["llama"], queued=False,
                                     device_process=device_process)
    queued, positions = _run(tiny_checkpoints["llama"], queued=True,
                             device_process=device_process)
    assert queued == sequential
    assert all(len(step) == 2 for step in queued)
    # each queued frame advanced the rows it decoded: prompt length + 3 steps
    assert positions == seq_positions == [len(PROMPT) + 3, len(PROMPT) - 1 + 3]
