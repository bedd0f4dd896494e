"""A synchronous reference driver for speculative rounds (the speculative program tests).

Extends ``ReferenceDriver`` (host mirror of positions and pages) with one call per
complete speculative round: it reserves pages for each lane's limit, binds a
``SpeculativeFrame``, executes, reads the result and advances the mirror by each
lane's emitted count. It owns nothing the runtime needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu.frames import FRAME_KEY, GREEDY, NO_PROMPT_ROW, SamplingParams, StateUpdate
from gpu.programs.driver import ReferenceDriver
from gpu.programs.speculative_frames import (
    SpeculativeFrame,
    SpeculativeMixedFrame,
    SpeculativeMixedResult,
    SpeculativeResult,
    speculative_result_of,
)
from policy.descriptors import GraphShape


class SpeculativeDriver(ReferenceDriver):
    """``ReferenceDriver`` plus complete speculative rounds."""

    def speculate(self, shape: GraphShape, rows: Sequence[int], limits: Sequence[int]
                  ) -> SpeculativeResult:
        """One round for ``rows`` with per-lane ``limits`` (query lengths or ceilings)."""
        program = self.engine.programs[shape]  # a SpeculativeProgram or a captured one
        updates: tuple[StateUpdate, ...] = ()
        for row, limit in zip(rows, limits, strict=True):
            updates += self.pages_for(row, self.rows[row].position + limit)
        frame = SpeculativeFrame(rows=tuple(rows), limits=tuple(limits), updates=updates)
        program.bind({FRAME_KEY: frame})
        program.execute()
        result = speculative_result_of(program.read_outputs())
        assert isinstance(result, SpeculativeResult)
        for lane in result.lanes:
            self.rows[lane.row].position += len(lane.tokens)
        return result

    def speculate_mixed(
        self, shape: GraphShape, rows: Sequence[int], limits: Sequence[int], *,
        prefill_row: int = NO_PROMPT_ROW, prompt: Sequence[int] = (), prompt_start: int = 0,
        prompt_ends: bool = False, sampling: SamplingParams = GREEDY,
    ) -> SpeculativeMixedResult:
        """One wider speculative mixed frame; a prompt lane starting at 0 initialises
        its row (its limit must be 0)."""
        updates: tuple[StateUpdate, ...] = ()
        for lane, (row, limit) in enumerate(zip(rows, limits, strict=True)):
            if lane == prefill_row:
                if prompt_start == 0:
                    updates += (self.init_row(row, sampling),)
                updates += self.pages_for(row, prompt_start + len(prompt))
            else:
                updates += self.pages_for(row, self.rows[row].position + limit)
        frame = SpeculativeMixedFrame(
            rows=tuple(rows), limits=tuple(limits), prefill_row=prefill_row,
            prompt_tokens=tuple(prompt), prompt_start=prompt_start, prompt_ends=prompt_ends,
            updates=updates)
        program = self.engine.programs[shape]
        program.bind({FRAME_KEY: frame})
        program.execute()
        result = speculative_result_of(program.read_outputs())
        assert isinstance(result, SpeculativeMixedResult)
        if prefill_row != NO_PROMPT_ROW:
            self.rows[rows[prefill_row]].position = prompt_start + len(prompt)
        for lane in result.speculative.lanes:
            self.rows[lane.row].position += len(lane.tokens)
        return result
