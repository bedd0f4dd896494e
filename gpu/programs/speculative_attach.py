"""Attach speculation to a loaded engine: build its complete speculative programs and
keep the draft context current in its ordinary ones (``attach_speculation``).

``ModelEngine.load`` builds the ordinary shapes of a catalog and hands the speculative
ones (``is_speculative_shape``) here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpu.draft_state import (
    DraftMaintainingProgram,
    DraftMaintainingStateOp,
    DraftState,
    load_draft_model,
)
from gpu.engine_parts import ProgramHost, UnsupportedShapeError
from gpu.frames import TOP_LOGPROBS
from gpu.programs.speculative import SpeculativeProgram
from gpu.programs.speculative_binding import LEARNED
from gpu.programs.speculative_mixed import SpeculativeMixedProgram
from gpu.programs.state_ops import StateOpProgram
from gpu.programs.step import StepProgram
from gpu.programs.workspace import Workspace
from gpu.speculative.copy_proposals import COPY_MAX_NGRAM
from policy.descriptors import GraphKind, GraphShape


def attach_speculation(
    engine: ProgramHost, shapes: Sequence[GraphShape], *, source: str,
    draft_model_dir: str | Path | None = None, copy_max_ngram: int = COPY_MAX_NGRAM,
    draft_catch_up: int = 0,
) -> DraftState:
    """Give ``engine`` speculative programs for ``shapes`` (``SPECULATIVE`` shapes and
    ``speculation_enabled`` mixed shapes of any width; proposal ``source``: ``"draft"``
    with ``draft_model_dir``, or ``"copy"``) and wrap its prefill / decode / mixed
    programs and state operations so they keep the draft context and token history
    current (SPEC-5); ``draft_catch_up = K > 0`` lets the learned draft's context lag
    behind ordinary decodes and catch up, at most K positions, inside the next round
    (``gpu.draft_state``). Returns the shared draft state."""
    parts = engine.parts
    draft = None
    if source == LEARNED:
        if draft_model_dir is None:
            raise ValueError("the learned draft source needs draft_model_dir")
        draft = load_draft_model(draft_model_dir, target=parts.decoder, target_cache=parts.cache)
    draft_state = DraftState(parts.state, draft, device=engine.device, catch_up=draft_catch_up)
    for shape, program in list(engine.programs.items()):
        if isinstance(program, StepProgram):
            engine.programs[shape] = DraftMaintainingProgram(program, draft_state)
        elif isinstance(program, StateOpProgram):
            engine.programs[shape] = DraftMaintainingStateOp(program, draft_state)
    for shape in shapes:
        if shape.kind is GraphKind.MIXED and shape.token_capacity > 1:
            engine.programs[shape] = SpeculativeMixedProgram(
                shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
                draft_state=draft_state, source=source, copy_max_ngram=copy_max_ngram,
                execution=parts.execution)
            continue
        if shape.kind is GraphKind.MIXED:
            engine.programs[shape] = DraftMaintainingProgram(
                _width_one_mixed(shape, engine), draft_state)
            continue
        engine.programs[shape] = SpeculativeProgram(
            shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
            draft_state=draft_state, source=source, copy_max_ngram=copy_max_ngram,
            execution=parts.execution)
    return draft_state


def is_speculative_shape(shape: GraphShape) -> bool:
    """Whether ``attach_speculation`` (not ``ModelEngine.load``) builds ``shape``."""
    return shape.kind is GraphKind.SPECULATIVE or (
        shape.kind is GraphKind.MIXED and shape.speculation_enabled)


def _width_one_mixed(shape: GraphShape, engine: ProgramHost) -> StepProgram:
    """The ordinary program behind a ``speculation_enabled`` width-one mixed shape
    (MIX-6, MIX-35: decode attention and direct updates; the wrapper keeps the draft
    context). Wider ones are ``SpeculativeMixedProgram``s."""
    if shape.token_capacity != 1 or not shape.speculation_enabled:
        raise UnsupportedShapeError(
            f"{shape.label()}: only width-one draft-maintaining mixed programs are built")
    parts = engine.parts
    workspace = parts.workspace
    if shape.max_packed_extent > workspace.max_tokens or shape.batch_capacity > \
            workspace.max_lanes:
        # the engine's workspace was sized without this shape: give it its own
        device = str(parts.state.pending_token.device)
        workspace = Workspace(
            max_tokens=shape.max_packed_extent, max_lanes=shape.batch_capacity,
            device=device, sink_row=parts.state.sink_row,
            sink_page=parts.cache.geometry.sink_page,
            top_width=min(TOP_LOGPROBS, parts.decoder.config.vocab_size))
    return StepProgram(shape, decoder=parts.decoder, cache=parts.cache, state=parts.state,
                       workspace=workspace, execution=parts.execution, vision=parts.vision)
