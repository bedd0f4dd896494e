"""A synchronous reference driver for speculative rounds (tests, benchmarks, smoke checks).

Extends ``ReferenceDriver`` (host mirror of positions and pages) with one call per
complete speculative round: it reserves pages for each lane's limit, binds a
``SpeculativeFrame``, executes, reads the result and advances the mirror by each
lane's emitted count. It owns nothing the runtime needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu.frames import FRAME_KEY, RESULT_KEY, StateUpdate
from gpu.programs.driver import ReferenceDriver
from gpu.programs.speculative import SpeculativeFrame, SpeculativeResult
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
        result = program.read_outputs()[RESULT_KEY]
        assert isinstance(result, SpeculativeResult)
        for lane in result.lanes:
            self.rows[lane.row].position += len(lane.tokens)
        return result
