"""Greedy continuation through our prepared programs equals transformers' greedy
``generate``, token for token, for every tiny architecture (Llama tied/untied,
Qwen2 with q/k/v bias, Qwen3 with q/k norm; all with GQA except llama_untied).

Programs are driven directly (bind -> execute -> read_outputs), no backend. Covers
chunked prefill at several chunk sizes, decode at several batch capacities with
padding rows (SPEC-10: 3 requests on B=4), mixed frames (MIX-13, MIX-33, MIX-34,
MIX-38: mixed output equals separate prefill + decode), and snapshot -> restore ->
continue (PRE-37).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_fixtures import (
    DECODE,
    MIXED_2,
    MIXED_4,
    MODEL_KINDS,
    PREFILL_64,
    PREFILL_128,
    RESTORE,
    SNAPSHOT,
    HFReference,
    build_engine,
    prompt_of,
)

from gpu.frames import NO_PROMPT_ROW, PageAppend, PrefillFrame, RowInit
from gpu.programs.driver import ReferenceDriver, RowMirror

NEW_TOKENS = 10


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize(("shape", "chunk"), [(PREFILL_64, 7), (PREFILL_64, 64), (PREFILL_128, 100)])
def test_chunked_prefill_then_decode_equals_generate(
    kind: str, shape, chunk: int, tiny_checkpoints: dict[str, Path], hf_reference: HFReference
) -> None:
    """Chunked prefill (any cached start position) then B=1 decode matches generate."""
    prompt = prompt_of(150, seed=11)
    expected = hf_reference.greedy(kind, prompt, NEW_TOKENS)
    driver = ReferenceDriver(build_engine(tiny_checkpoints[kind]))
    tokens = [driver.prefill(shape, 5, prompt, chunk=chunk)]
    while len(tokens) < NEW_TOKENS:
        tokens += driver.decode(DECODE[1], [5])
    assert tokens == expected


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize(("capacity", "active"), [(2, 2), (4, 3), (8, 5)])
def test_spec_10_decode_with_padding_rows_equals_generate(
    kind: str, capacity: int, active: int,
    tiny_checkpoints: dict[str, Path], hf_reference: HFReference,
) -> None:
    """Requests of different lengths decode together on a padded power-of-two batch."""
    prompts = [prompt_of(9 + 13 * i, seed=100 + i) for i in range(active)]
    expected = [hf_reference.greedy(kind, p, NEW_TOKENS) for p in prompts]
    driver = ReferenceDriver(build_engine(tiny_checkpoints[kind]))
    rows = [7 - 2 * i if 7 - 2 * i >= 0 else i for i in range(active)]  # slot ids not lane order
    rows = list(dict.fromkeys(rows))
    assert len(rows) == active
    outputs = {row: [driver.prefill(PREFILL_64, row, p, chunk=64)] for row, p in zip(rows, prompts, strict=True)}
    for _ in range(NEW_TOKENS - 1):
        for row, token in zip(rows, driver.decode(DECODE[capacity], rows), strict=True):
            outputs[row].append(token)
    assert [outputs[row] for row in rows] == expected


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_mix_33_mixed_frames_equal_generate(
    kind: str, tiny_checkpoints: dict[str, Path], hf_reference: HFReference
) -> None:
    """A decoding request and a chunked prompt share mixed frames; then decode-only
    mixed frames (prefill_row -1) carry both; each stream equals generate."""
    first, second = prompt_of(20, seed=1), prompt_of(90, seed=2)
    expected_first = hf_reference.greedy(kind, first, 16)
    expected_second = hf_reference.greedy(kind, second, NEW_TOKENS)
    driver = ReferenceDriver(build_engine(tiny_checkpoints[kind]))
    out_first = [driver.prefill(PREFILL_64, 6, first, chunk=64)]
    out_second: list[int] = []
    # second prompt in chunks of 50 and 40, prompt lane first, then last (lane order is free)
    for lanes, prefill_lane, start, end in (((3, 6), 0, 0, 50), ((6, 3), 1, 50, 90)):
        result = driver.mixed(
            MIXED_4, lanes, prefill_row=prefill_lane, prompt=second[start:end],
            prompt_start=start, prompt_ends=end == len(second),
        )
        by_row = {s.row: s.token for s in result.samples}
        out_first.append(by_row[6])
        if 3 in by_row:
            out_second.append(by_row[3])
    assert len(out_second) == 1
    while len(out_second) < NEW_TOKENS:
        result = driver.mixed(MIXED_2, (6, 3), prefill_row=NO_PROMPT_ROW)
        by_row = {s.row: s.token for s in result.samples}
        out_first.append(by_row[6])
        out_second.append(by_row[3])
    assert out_second == expected_second
    assert out_first == expected_first[: len(out_first)]


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_pre_37_snapshot_restore_continue_equals_uninterrupted(
    kind: str, tiny_checkpoints: dict[str, Path], hf_reference: HFReference
) -> None:
    """Snapshot a request with a partial last page, keep decoding it (which writes into
    its partial page), restore the checkpoint into a fresh row and continue: the
    restored stream equals the uninterrupted one and generate."""
    prompt = prompt_of(37, seed=5)  # 37 = 2 full pages of 16 + a partial page
    expected = hf_reference.greedy(kind, prompt, 14)
    driver = ReferenceDriver(build_engine(tiny_checkpoints[kind]))
    tokens = [driver.prefill(PREFILL_64, 0, prompt, chunk=64)]
    tokens += driver.decode(DECODE[1], [0]) + driver.decode(DECODE[1], [0])
    driver.copy_row(SNAPSHOT, 0, 4)  # checkpoint row 4
    original = list(tokens)
    for _ in range(11):
        original += driver.decode(DECODE[1], [0])
    assert original == expected
    driver.release(0)
    driver.copy_row(RESTORE, 4, 1)  # fresh request row 1
    restored = list(tokens)
    for _ in range(11):
        restored += driver.decode(DECODE[2], [1])
    assert restored == expected


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prefill_from_a_shared_cached_prefix_equals_generate(
    kind: str, tiny_checkpoints: dict[str, Path], hf_reference: HFReference
) -> None:
    """A second request reuses the first one's four full pages by reference (a prefix
    cache hit: RowInit at position 64 + PageAppend of the shared pages) and prefills
    only its own suffix; its continuation equals generate on the whole prompt, and
    the first request is unaffected."""
    first = prompt_of(70, seed=21)
    second = first[:64] + prompt_of(30, seed=22)
    expected_first = hf_reference.greedy(kind, first, 6)
    expected_second = hf_reference.greedy(kind, second, 6)
    driver = ReferenceDriver(build_engine(tiny_checkpoints[kind]))
    out_first = [driver.prefill(PREFILL_64, 0, first, chunk=64)]
    shared = tuple(driver.rows[0].pages[:4])
    own = (driver.free_pages.pop(0), driver.free_pages.pop(0))
    result = driver.run(PREFILL_64, PrefillFrame(
        row=1, tokens=tuple(second[64:]), start_position=64, ends_prompt=True,
        updates=(RowInit(row=1, position=64), PageAppend(row=1, first_block=0, page_ids=shared),
                 PageAppend(row=1, first_block=4, page_ids=own)),
    ))
    driver.rows[1] = RowMirror(position=len(second), pages=[*shared, *own])
    out_second = [result.samples[0].token]  # type: ignore[union-attr]
    for _ in range(5):
        a, b = driver.decode(DECODE[2], [0, 1])
        out_first.append(a)
        out_second.append(b)
    assert out_first == expected_first
    assert out_second == expected_second
