"""Native input and state-mutation contracts of the prepared programs.

Covers MIX-15 / VER-19 (inactive rows, padding lanes and unused token capacity mutate
nothing: state and KV pages bitwise unchanged), VER-17 / MIX-12 / MIX-13 (packed
offsets are prefix sums of query lengths, independent of slot ids; the prompt sits at
its lane's offset), VER-20 / MIX-8 / MIX-9 (role validation: invalid prefill_row,
prompt tokens without a prompt row, duplicate rows, over-capacity frames are rejected
before anything is written), page copy, initialize, and snapshot block-table sharing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import (
    DECODE,
    INITIALIZE,
    MIXED_4,
    PAGE_COPY,
    PAGE_SIZE,
    PREFILL_64,
    RESTORE,
    SNAPSHOT,
    build_engine,
    prompt_of,
)

from gpu.engine import ModelEngine
from gpu.frames import (
    NO_PROMPT_ROW,
    DecodeFrame,
    FrameError,
    MixedFrame,
    PageAppend,
    PrefillFrame,
    RowCopy,
    RowInit,
    SamplingParams,
    StateOpFrame,
    as_inputs,
)
from gpu.programs.driver import ReferenceDriver
from gpu.programs.packing import packed_offsets
from gpu.programs.step import StepProgram


@pytest.fixture
def engine(tiny_checkpoints: dict[str, Path]) -> ModelEngine:
    return build_engine(tiny_checkpoints["qwen3"])


def _state_copy(engine: ModelEngine) -> dict[str, torch.Tensor]:
    st = engine.parts.state
    out = {name: t.clone() for name, t in st.fields().items()}
    out["keys"] = engine.parts.cache.keys.clone()
    out["values"] = engine.parts.cache.values.clone()
    return out


def _changed_rows(before: dict[str, torch.Tensor], engine: ModelEngine) -> set[int]:
    """State rows (excluding the sink) whose any field differs bitwise."""
    rows = set()
    for name, tensor in engine.parts.state.fields().items():
        diff = before[name][:-1] != tensor[:-1]
        if diff.dim() > 1:
            diff = diff.flatten(1).any(dim=1)
        rows |= {int(i) for i in torch.nonzero(diff).flatten()}
    return rows


def _changed_pages(before: dict[str, torch.Tensor], engine: ModelEngine) -> set[int]:
    """Real pages (excluding the sink) whose keys or values differ bitwise."""
    pages = set()
    for name, tensor in (("keys", engine.parts.cache.keys), ("values", engine.parts.cache.values)):
        diff = (before[name] != tensor)[:, :-1].transpose(0, 1).flatten(1).any(dim=1)
        pages |= {int(i) for i in torch.nonzero(diff).flatten()}
    return pages


def _prefilled(engine: ModelEngine, rows: dict[int, int]) -> ReferenceDriver:
    driver = ReferenceDriver(engine)
    for row, length in rows.items():
        driver.prefill(PREFILL_64, row, prompt_of(length, seed=row), chunk=64)
    return driver


def test_mix_15_ver_19_decode_padding_rows_mutate_nothing(engine: ModelEngine) -> None:
    driver = _prefilled(engine, {0: 20, 1: 30, 2: 17})
    before = _state_copy(engine)
    row1_page = driver.rows[1].pages[30 // PAGE_SIZE]
    driver.decode(DECODE[8], [1])  # one active lane, seven padding lanes
    assert _changed_rows(before, engine) == {1}
    assert _changed_pages(before, engine) == {row1_page}
    st = engine.parts.state
    assert int(st.position[1]) == 31


def test_mix_15_prefill_padding_tokens_write_only_their_pages(engine: ModelEngine) -> None:
    driver = _prefilled(engine, {0: 20})
    before = _state_copy(engine)
    driver.prefill(PREFILL_64, 3, prompt_of(5, seed=9), chunk=64)  # 59 padding slots
    assert _changed_rows(before, engine) == {3}
    assert _changed_pages(before, engine) == set(driver.rows[3].pages)


def test_mix_15_mixed_unused_rows_and_capacity_mutate_nothing(engine: ModelEngine) -> None:
    driver = _prefilled(engine, {0: 20, 1: 33, 2: 40})
    before = _state_copy(engine)
    prompt = prompt_of(10, seed=4)
    driver.mixed(MIXED_4, (2, 5), prefill_row=1, prompt=prompt, prompt_start=0,
                 prompt_ends=False)
    assert _changed_rows(before, engine) == {2, 5}
    st = engine.parts.state
    assert int(st.position[5]) == 10
    assert int(st.pending_token[5]) == 0  # a non-final chunk publishes nothing
    assert _changed_pages(before, engine) == set(driver.rows[5].pages) | {
        driver.rows[2].pages[40 // PAGE_SIZE]
    }


def test_ver_17_mix_12_offsets_are_prefix_sums_independent_of_slot_ids(
    engine: ModelEngine,
) -> None:
    assert packed_offsets([1, 40, 1, 1]).tolist() == [0, 1, 41, 42]
    program = engine.programs[MIXED_4]
    assert isinstance(program, StepProgram)
    prompt = tuple(prompt_of(40, seed=3))
    layouts = []
    for rows in ((0, 1, 2, 3), (7, 4, 6, 5)):
        pack, _ = program.pack(as_inputs(MixedFrame(
            rows=rows, prefill_row=1, prompt_tokens=prompt, prompt_start=0,
        )))
        layouts.append(pack)
        # MIX-13: the prompt's first token sits at offsets[prefill_row]
        assert pack.host_token[pack.offsets[1]] == prompt[0]
        assert pack.host_token[pack.offsets[1] + 39] == prompt[-1]
        assert pack.query_lengths.tolist() == [1, 40, 1, 1]
    assert layouts[0].offsets.tolist() == layouts[1].offsets.tolist() == [0, 1, 41, 42]
    assert np.array_equal(layouts[0].token_lane, layouts[1].token_lane)


def test_ver_17_bound_buffers_hold_the_packed_layout(engine: ModelEngine) -> None:
    """MIX-14: decode lanes read their pending token from state; the prompt lane's
    tokens and positions are uploaded at its offset."""
    _prefilled(engine, {0: 20, 1: 30})
    program = engine.programs[MIXED_4]
    assert isinstance(program, StepProgram)
    prompt = tuple(prompt_of(12, seed=8))
    program.bind(as_inputs(MixedFrame(
        rows=(0, 3, 1), prefill_row=1, prompt_tokens=prompt, prompt_start=0,
        updates=(RowInit(row=3), PageAppend(row=3, first_block=0, page_ids=(60,))),
    )))
    b = program.buffers
    assert b.from_state[:14].tolist() == [True] + [False] * 12 + [True]
    assert b.host_token[1:13].tolist() == list(prompt)
    assert b.host_position[1:13].tolist() == list(range(12))
    assert not b.valid[14:].any()
    assert b.lane_rows.tolist() == [0, 3, 1, engine.parts.state.sink_row]
    # phase workspaces: prompt queries at its offset, one decode query per decode lane
    n = program.shape.max_packed_extent
    assert b.prompt_slots.tolist() == list(range(1, 13)) + [n] * (64 - 12)
    assert b.decode_slots.tolist() == [0, n, 13, n]
    assert b.prompt_lane.tolist() == [1]


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (MixedFrame(rows=(0, 1), prefill_row=2, prompt_tokens=(5,)), "prefill_row"),
        (MixedFrame(rows=(0, 1), prefill_row=-2, prompt_tokens=(5,)), "prefill_row"),
        (MixedFrame(rows=(0, 1), prefill_row=NO_PROMPT_ROW, prompt_tokens=(5,)), "prompt row"),
        (MixedFrame(rows=(0, 1), prefill_row=0), "at least one prompt token"),
        (MixedFrame(rows=(0, 0)), "twice"),
        (MixedFrame(rows=(0, 1, 2, 3, 4)), "batch capacity"),
        (MixedFrame(rows=(0, 1), prefill_row=0, prompt_tokens=(5,) * 65), "capacity"),
        (MixedFrame(rows=(0, 99)), "state row"),
        (MixedFrame(rows=(0, 1), prefill_row=0, prompt_tokens=(500,)), "vocabulary"),
        (DecodeFrame(rows=(0,)), "MixedFrame"),
        (MixedFrame(rows=(0,), updates=(PageAppend(row=0, first_block=0, page_ids=(64,)),)),
         "page"),
    ],
)
def test_ver_20_role_validation_rejects_before_writing(
    engine: ModelEngine, frame: object, message: str
) -> None:
    _prefilled(engine, {0: 20, 1: 30})
    before = _state_copy(engine)
    with pytest.raises(FrameError, match=message):
        engine.programs[MIXED_4].bind({"frame": frame})
    assert _changed_rows(before, engine) == set()


def test_prefill_frame_checks(engine: ModelEngine) -> None:
    program = engine.programs[PREFILL_64]
    with pytest.raises(FrameError, match="capacity"):
        program.bind(as_inputs(PrefillFrame(row=0, tokens=(5,) * 65, start_position=0,
                                            ends_prompt=True)))
    with pytest.raises(FrameError, match="frame"):
        program.bind({"frame": "not a frame"})


def test_page_copy_copies_whole_pages(engine: ModelEngine) -> None:
    driver = _prefilled(engine, {0: 40})
    src = driver.rows[0].pages
    before = _state_copy(engine)
    driver.run(PAGE_COPY, StateOpFrame(page_pairs=((src[0], 50), (src[2], 51))))
    cache = engine.parts.cache
    assert torch.equal(cache.keys[:, 50], cache.keys[:, src[0]])
    assert torch.equal(cache.values[:, 51], cache.values[:, src[2]])
    assert _changed_pages(before, engine) == {50, 51}
    assert _changed_rows(before, engine) == set()


def test_initialize_sets_sampling_and_position(engine: ModelEngine) -> None:
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=123)
    driver = ReferenceDriver(engine)
    driver.run(INITIALIZE, StateOpFrame(updates=(RowInit(row=2, position=32, sampling=sampling),
                                                 PageAppend(row=2, first_block=0,
                                                            page_ids=(9, 10)))))
    st = engine.parts.state
    assert int(st.position[2]) == 32 and int(st.seed[2]) == 123 and int(st.top_k[2]) == 5
    assert st.block_table[2, :3].tolist() == [9, 10, engine.geometry.sink_page]
    assert float(st.temperature[2]) == pytest.approx(0.7)


def test_pre_37_snapshot_shares_full_pages_and_copies_the_partial_page(
    engine: ModelEngine,
) -> None:
    driver = _prefilled(engine, {0: 37})
    pages = driver.rows[0].pages
    driver.copy_row(SNAPSHOT, 0, 6)
    st, cache = engine.parts.state, engine.parts.cache
    table = st.block_table[6].tolist()
    assert table[:2] == pages[:2]  # full pages shared by reference
    copy = table[2]
    assert copy not in pages
    assert torch.equal(cache.keys[:, copy], cache.keys[:, pages[2]])
    assert int(st.position[6]) == 37 and int(st.pending_token[6]) == int(st.pending_token[0])
    assert set(table[3:]) == {engine.geometry.sink_page}


def test_mix_15_execute_before_any_bind_touches_only_the_sink(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """Warm-up and capture run ``execute`` before any frame is bound: that must not
    mutate real rows or pages (the workspace starts addressed at the sink)."""
    engine = build_engine(tiny_checkpoints["llama"])
    st = engine.parts.state
    st.position[:-1] = torch.arange(st.rows) + 3
    st.pending_token[:-1] = 7
    engine.parts.cache.keys[:, :-1] = 1.5
    before = _state_copy(engine)
    for shape in sorted(engine.programs, key=lambda s: -s.max_packed_extent):
        engine.programs[shape].execute()
    assert _changed_rows(before, engine) == set()
    assert _changed_pages(before, engine) == set()


def test_restore_for_a_new_generation_takes_its_own_sampling(engine: ModelEngine) -> None:
    """A prompt checkpoint restored for another request keeps the cached extent but
    samples with the new request's parameters and seed."""
    driver = _prefilled(engine, {0: 20})
    new = SamplingParams(temperature=0.5, top_p=0.8, top_k=7, seed=99)
    driver.run(RESTORE, StateOpFrame(copies=(RowCopy(src_row=0, dst_row=3, dst_page=40,
                                                     sampling=new),)))
    st = engine.parts.state
    assert int(st.position[3]) == 20 and int(st.seed[3]) == 99 and int(st.top_k[3]) == 7
    assert float(st.temperature[3]) == pytest.approx(0.5)
    assert float(st.top_p[3]) == pytest.approx(0.8)
    assert float(st.temperature[0]) == 0.0 and int(st.seed[0]) == 0


def test_decode_past_the_context_is_inert_and_flagged(tiny_checkpoints: dict[str, Path]) -> None:
    """A lane whose position reached the context limit writes no real page and reports
    a non-finite sample (the validator then fails that lane only); its neighbour in
    the same frame decodes normally."""
    engine = ModelEngine.load(tiny_checkpoints["llama"], device="cpu", dtype=None,
                              catalog=(DECODE[2],), page_size=PAGE_SIZE, num_pages=8,
                              state_rows=2, max_context=64)
    assert engine.geometry.max_context == 64
    driver = ReferenceDriver(engine)
    updates = (RowInit(row=0, position=63), PageAppend(row=0, first_block=0, page_ids=(0, 1, 2, 3)),
               RowInit(row=1, position=63), PageAppend(row=1, first_block=0, page_ids=(4, 5, 6, 7)))
    driver.run(DECODE[2], DecodeFrame(rows=(1,), updates=updates))  # row 1 reaches 64
    before = _state_copy(engine)
    result = driver.run(DECODE[2], DecodeFrame(rows=(0, 1)))
    assert [s.finite for s in result.samples] == [True, False]
    assert _changed_pages(before, engine) == {3}
