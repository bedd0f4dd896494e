"""A synchronous reference driver: runs requests through prepared programs directly.

Owns nothing the runtime needs; it exists so tests, benchmarks and smoke checks can
drive programs (``bind -> execute -> read_outputs``) without a backend or scheduler.
It keeps the host mirror the runtime keeps (each row's position and pages), hands out
pages from a simple free list, and builds frames with the page appends a step needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpu.engine import ModelEngine
from gpu.frames import (
    GREEDY,
    NO_PROMPT_ROW,
    DecodeFrame,
    Frame,
    MixedFrame,
    PageAppend,
    PrefillFrame,
    Result,
    RowCopy,
    RowInit,
    SamplingParams,
    StateOpFrame,
    StateOpResult,
    StateUpdate,
    StepResult,
    as_inputs,
    result_of,
)
from gpu.program import PreparedProgram
from policy.descriptors import GraphShape


@dataclass
class RowMirror:
    """The host's view of one state row."""

    position: int = 0
    pages: list[int] = field(default_factory=list)


class ReferenceDriver:
    """Drive an engine's programs one frame at a time."""

    def __init__(self, engine: ModelEngine) -> None:
        self.engine = engine
        self.page_size = engine.geometry.page_size
        self.free_pages = list(range(engine.geometry.num_pages))
        self.rows: dict[int, RowMirror] = {}

    def run(self, shape: GraphShape | PreparedProgram, frame: Frame) -> Result:
        program = self.engine.programs[shape] if isinstance(shape, GraphShape) else shape
        program.bind(as_inputs(frame))
        program.execute()
        return result_of(program.read_outputs())

    def _step(self, shape: GraphShape, frame: Frame) -> StepResult:
        result = self.run(shape, frame)
        assert isinstance(result, StepResult)
        return result

    def init_row(self, row: int, sampling: SamplingParams = GREEDY, *,
                 prompt: Sequence[int] = (), end_token_ids: Sequence[int] = ()) -> RowInit:
        """A fresh row; ``prompt`` and ``end_token_ids`` are what ``RowInit`` carries
        for the repetition penalty and ``min_tokens``."""
        self.release(row)
        self.rows[row] = RowMirror()
        return RowInit(row=row, sampling=sampling, prompt_tokens=tuple(prompt),
                       end_token_ids=tuple(end_token_ids))

    def release(self, row: int) -> None:
        mirror = self.rows.pop(row, None)
        if mirror is not None:
            self.free_pages.extend(mirror.pages)

    def pages_for(self, row: int, end_position: int) -> tuple[StateUpdate, ...]:
        """Page appends so ``row`` can hold positions ``< end_position``."""
        mirror = self.rows[row]
        needed = -(-end_position // self.page_size) - len(mirror.pages)
        if needed <= 0:
            return ()
        new = [self.free_pages.pop(0) for _ in range(needed)]
        first = len(mirror.pages)
        mirror.pages.extend(new)
        return (PageAppend(row=row, first_block=first, page_ids=tuple(new)),)

    def prefill(
        self,
        shape: GraphShape,
        row: int,
        prompt: Sequence[int],
        *,
        chunk: int,
        sampling: SamplingParams = GREEDY,
        end_token_ids: Sequence[int] = (),
    ) -> int:
        """Run the whole prompt in chunks of ``chunk`` tokens; return the first output token."""
        updates: tuple[StateUpdate, ...] = (
            self.init_row(row, sampling, prompt=prompt, end_token_ids=end_token_ids),)
        token = -1
        for start in range(0, len(prompt), chunk):
            piece = tuple(prompt[start:start + chunk])
            end = start + len(piece)
            updates += self.pages_for(row, end)
            result = self._step(shape, PrefillFrame(
                row=row, tokens=piece, start_position=start, ends_prompt=end == len(prompt),
                updates=updates,
            ))
            updates = ()
            self.rows[row].position = end
            if result.samples:
                token = result.samples[0].token
        return token

    def decode(self, shape: GraphShape, rows: Sequence[int]) -> list[int]:
        updates: tuple[StateUpdate, ...] = ()
        for row in rows:
            updates += self.pages_for(row, self.rows[row].position + 1)
            self.rows[row].position += 1
        result = self._step(shape, DecodeFrame(rows=tuple(rows), updates=updates))
        return [s.token for s in result.samples]

    def mixed(
        self,
        shape: GraphShape,
        rows: Sequence[int],
        *,
        prefill_row: int = NO_PROMPT_ROW,
        prompt: Sequence[int] = (),
        prompt_start: int = 0,
        prompt_ends: bool = False,
        sampling: SamplingParams = GREEDY,
    ) -> StepResult:
        """One mixed frame; a prompt lane starting at 0 initialises its row."""
        updates: tuple[StateUpdate, ...] = ()
        for lane, row in enumerate(rows):
            if lane == prefill_row:
                if prompt_start == 0:
                    updates += (self.init_row(row, sampling),)
                updates += self.pages_for(row, prompt_start + len(prompt))
                self.rows[row].position = prompt_start + len(prompt)
            else:
                updates += self.pages_for(row, self.rows[row].position + 1)
                self.rows[row].position += 1
        return self._step(shape, MixedFrame(
            rows=tuple(rows), prefill_row=prefill_row, prompt_tokens=tuple(prompt),
            prompt_start=prompt_start, prompt_ends=prompt_ends, updates=updates,
        ))

    def copy_row(self, shape: GraphShape, src: int, dst: int) -> StateOpResult:
        """Snapshot or restore ``src -> dst``: share full pages, copy the partial one."""
        mirror = self.rows[src]
        self.release(dst)
        full = mirror.position // self.page_size
        shared = mirror.pages[:full]
        dst_page = -1
        pages = list(shared)
        if mirror.position % self.page_size:
            dst_page = self.free_pages.pop(0)
            pages.append(dst_page)
        self.rows[dst] = RowMirror(position=mirror.position, pages=pages)
        result = self.run(shape, StateOpFrame(
            copies=(RowCopy(src_row=src, dst_row=dst, dst_page=dst_page),)
        ))
        assert isinstance(result, StateOpResult)
        return result
