"""Top alternatives follow what the rows ask for: an eager step program computes the most
any active row of its frame asks for (``RowInit.top_logprobs``), none when no row asks,
and the alternatives it does compute are the static programs' (which always compute
``TOP_LOGPROBS``); tokens do not depend on it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from model_fixtures import CATALOG, DECODE, PAGE_SIZE, PREFILL_64, prompt_of

from gpu.engine import ModelEngine
from gpu.frames import TOP_LOGPROBS, DecodeFrame, PrefillFrame
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions

ASKED = {0: 0, 1: 3, 2: 0}
"""Alternatives each row's request asks for."""


def _driver(model_dir: Path, execution: ExecutionOptions) -> ReferenceDriver:
    return ReferenceDriver(ModelEngine.load(
        model_dir, device="cpu", dtype=None, catalog=CATALOG, page_size=PAGE_SIZE,
        num_pages=64, state_rows=8, execution=execution))


def _run(driver: ReferenceDriver, *, asked: dict[int, int]) -> list[list[tuple[int, int]]]:
    """Prefill each row with its own top count, then decode [0, 2] and [0, 1, 2] twice;
    per frame: (token, number of alternatives) of each sample."""
    for row, k in asked.items():
        prompt = prompt_of(20 + 7 * row, seed=row)
        updates = (replace(driver.init_row(row), top_logprobs=k),
                   *driver.pages_for(row, len(prompt)))
        driver.run(PREFILL_64, PrefillFrame(row=row, tokens=tuple(prompt), start_position=0,
                                            ends_prompt=True, updates=updates))
        driver.rows[row].position = len(prompt)
    frames = []
    for rows in ([0, 2], [0, 1, 2], [0, 2], [0, 1, 2]):
        updates = tuple(u for row in rows for u in driver.pages_for(
            row, driver.rows[row].position + 1))
        for row in rows:
            driver.rows[row].position += 1
        result = driver.run(DECODE[4], DecodeFrame(rows=tuple(rows), updates=updates))
        frames.append([(s.token, s.top_logprobs) for s in result.samples])  # type: ignore[union-attr]
    return frames


@pytest.mark.parametrize("kind", ["llama"])
def test_eager_programs_compute_only_the_alternatives_asked_for(
        kind: str, tiny_checkpoints: dict[str, Path]) -> None:
    eager = _run(_driver(tiny_checkpoints[kind], ExecutionOptions.eager()), asked=ASKED)
    static = _run(_driver(tiny_checkpoints[kind], ExecutionOptions.static()), asked=ASKED)
    assert [[t for t, _ in f] for f in eager] == [[t for t, _ in f] for f in static]
    widths = [[len(alts) for _, alts in f] for f in eager]
    assert widths == [[0, 0], [3, 3, 3], [0, 0], [3, 3, 3]]
    assert all(len(alts) == TOP_LOGPROBS for f in static for _, alts in f)
    for eager_frame, static_frame in zip(eager, static, strict=True):
        for (_, mine), (_, full) in zip(eager_frame, static_frame, strict=True):
            assert [i for i, _ in mine] == [i for i, _ in full[:len(mine)]]
            assert [lp for _, lp in mine] == pytest.approx(
                [lp for _, lp in full[:len(mine)]], rel=1e-5, abs=1e-5)
