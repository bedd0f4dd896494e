"""Mixed frames with speculative decode rows on a real tiny model, through the runtime's
own pieces: start-up capture (``actors.capture_warmup``), packing
(``actors.frame_inputs``), a CPU backend launch and validation
(``actors.completion_validator``). Plans are built by hand in the format the
speculating ``Scheduler`` produces (the planning half is not exercised here).

The learned draft is the target itself, so every greedy draft is accepted and each
round's tokens are the target's greedy continuation, compared with plain prefill and
decode on other rows of the same engine. Covers MIX-9, MIX-15, MIX-17, MIX-19, MIX-26,
MIX-28, MIX-29, MIX-43, VER-13, VER-28.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing

from actors.capture_warmup import capture_programs, warmup_frame
from actors.completion_validator import check_frame
from actors.frame_inputs import LaneSource, mark_submitted, pack_frame, settle_decodes
from actors.messages import (
    Fence,
    FrameOrder,
    FrameOutcome,
    PageId,
    PagePlan,
    RequestHandle,
    StateRow,
)
from actors.public import GenerationRequest
from gpu.backends.cpu import CpuBackend
from gpu.backends.protocol import Completion
from gpu.engine import ModelEngine, load_speculative_engine
from gpu.frames import FRAME_KEY, GREEDY, RESULT_KEY, TOP_LOGPROBS, MixedFrame
from gpu.program import PreparedProgram
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions
from gpu.programs.speculative_binding import LEARNED
from gpu.programs.speculative_frames import SpeculativeMixedFrame, SpeculativeMixedResult
from policy.descriptors import GraphKind, GraphShape
from policy.types import (
    DecodeMode,
    Lane,
    LaneRole,
    MixedRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)

PREFILL = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
DECODE = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1)
WIDE = GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=3, proposal_depth=2,
                  prefill_capacity=64, packed_capacity=64 + 3, speculation_enabled=True)
"""B=2, W=3, C=64: P=67."""
PAGE_SIZE = 16
VOCAB = 96


def load(model: Path) -> ModelEngine:
    return load_speculative_engine(
        model, catalog=(PREFILL, DECODE, WIDE), source=LEARNED, draft_model_dir=model,
        device="cpu", dtype=None, page_size=PAGE_SIZE, num_pages=32, state_rows=6,
        require_tokenizer=False, execution=ExecutionOptions.eager(capture_forward=True))


def launched(backend: CpuBackend, program: PreparedProgram, frame: object) -> Completion:
    """Launch ``frame`` and wait for its completion (``ProgramFault`` if it faulted)."""
    handle = backend.launch(program, {FRAME_KEY: frame})
    handle.wait()
    return handle.result()


@pytest.fixture()
def backend() -> Iterator[CpuBackend]:
    with CpuBackend(num_threads=0) as cpu:
        yield cpu


def test_mix_43_start_up_capture_runs_wider_mixed_programs_with_an_empty_frame(
    tiny_llama: Path, backend: CpuBackend
) -> None:
    """The warm-up frame of a wider speculative mixed program is an empty
    ``SpeculativeMixedFrame`` (an ordinary ``MixedFrame`` faults on it); the launch
    succeeds with no lanes and no first token, and captures the program's forwards."""
    engine = load(tiny_llama)
    program = engine.programs[WIDE]
    backend.prepare([program])
    assert warmup_frame(WIDE) == SpeculativeMixedFrame(rows=(), limits=())
    capture = engine.parts.decoder.capture
    assert capture is not None and len(capture) == 0
    with structlog.testing.capture_logs() as logs:
        assert capture_programs(backend, {WIDE: program}) == 1
    assert not [e for e in logs if e["event"] == "runtime.forward_capture_failed"]
    assert len(capture) > 0  # the packed target forward was traced
    result = launched(backend, program, warmup_frame(WIDE))
    mixed = result.outputs[RESULT_KEY]
    assert isinstance(mixed, SpeculativeMixedResult)
    assert mixed.speculative.lanes == () and mixed.prompt_sample is None
    with pytest.raises(Exception, match="SpeculativeMixedFrame"):
        launched(backend, program, MixedFrame(rows=()))


def _plan(lanes: tuple[Lane, ...]) -> ScheduledPlan:
    prefill_row = 0 if lanes[0].role is LaneRole.PROMPT else -1
    return ScheduledPlan(
        step=ScheduledStep(shape=WIDE, lanes=lanes, mixed=MixedRole(
            prefill_row=prefill_row, decode_mode=DecodeMode.SPECULATIVE)),
        estimated_duration_ns=1, scaled_score=1.0, scale_exponent=0, duration_known=True,
        stale=False, reason=SelectionReason.ORDINARY, requires_empty_window=False,
        planned_at_ns=0, start_ns=0, useful_value=1.0)


def _prompt(handle: int, start: int, tokens: int, total: int) -> Lane:
    return Lane(handle=RequestHandle(handle), epoch=1, role=LaneRole.PROMPT,
                prompt_start=start, prompt_tokens=tokens,
                token_ceiling=int(start + tokens == total))


def _decode(handle: int, ceiling: int) -> Lane:
    return Lane(handle=RequestHandle(handle), epoch=1, role=LaneRole.DECODE,
                token_ceiling=ceiling)


def test_ver_28_packed_plans_run_and_validate_to_the_target_greedy_output(
    tiny_llama: Path, backend: CpuBackend
) -> None:
    """A prompt-only frame (chunk before the end), a last chunk, a prompt chunk of a
    second request beside a decode lane at full width, and a decode-only frame: each
    packed from its plan, launched on the CPU backend and validated. Records commit
    the chunks, the first tokens and the accepted prefixes, equal to plain greedy."""
    engine = load(tiny_llama)
    program = engine.programs[WIDE]
    backend.prepare([program])
    prompts = {0: tuple(range(3, 23)), 1: tuple(range(40, 50))}  # 20 and 10 tokens
    reference = ReferenceDriver(engine)
    reference.free_pages = list(range(16, 32))  # rows 4 and 5; the frames use 0..15
    expected = {}
    for handle, prompt in prompts.items():
        tokens = [reference.prefill(PREFILL, handle + 4, prompt, chunk=64)]
        while len(tokens) < 6:
            tokens += reference.decode(DECODE, [handle + 4])
        expected[handle] = tokens
    sources = {RequestHandle(h): LaneSource(
        handle=RequestHandle(h), epoch=1, row=StateRow(h),
        request=GenerationRequest(prompt_token_ids=p, max_tokens=8), cached_tokens=0,
        cached_pages=(), sampling=GREEDY, eos_token_ids=()) for h, p in prompts.items()}
    pages_of = {0: [PageId(0), PageId(1)], 1: [PageId(2)]}  # two pages hold 32 positions
    checks = []

    def run(lanes: tuple[Lane, ...], fence: int) -> list[tuple[int, ...]]:
        plan = _plan(lanes)
        pages = [PagePlan(handle=lane.handle, row=StateRow(int(lane.handle)), first_block=0,
                          page_ids=tuple(pages_of[int(lane.handle)]))
                 for lane in lanes if pages_of[int(lane.handle)]]
        for lane in lanes:
            pages_of[int(lane.handle)] = []  # reserved once, in the request's first frame
        frame, contexts = pack_frame(plan, sources, pages)
        assert isinstance(frame, SpeculativeMixedFrame)
        mark_submitted(plan, sources)
        order = FrameOrder(fence=Fence(fence), plan=plan, frame=frame, lanes=contexts)
        completion = launched(backend, program, frame)
        check = check_frame(order, FrameOutcome(order=order, completion=completion,
                                                fault=None, wall_ns=1), vocab_size=VOCAB)
        assert check.failures == () and check.rounds is not None
        checks.append(check)
        for lane, record in zip(lanes, check.records, strict=True):
            settle_decodes(lane, sources[lane.handle], len(record.token_ids))
            assert record.prompt_tokens == lane.prompt_tokens
        return [record.token_ids for record in check.records]

    assert run((_prompt(0, 0, 12, 20),), 1) == [()]  # MIX-19: a prompt-only population
    assert run((_prompt(0, 12, 8, 20),), 2) == [(expected[0][0],)]
    # the prompt lane's first token reports its alternatives like any sample: greedy leads
    (first_top,) = checks[-1].top_logprobs[0]
    assert len(first_top) == TOP_LOGPROBS and first_top[0][0] == expected[0][0]
    assert first_top[0][1] == checks[-1].logprobs[0][0]
    # request 1's whole prompt beside request 0 at full width: 2 drafts, all accepted
    assert run((_prompt(1, 0, 10, 10), _decode(0, 3)), 3) == [
        (expected[1][0],), tuple(expected[0][1:4])]
    assert run((_decode(1, 3), _decode(0, 2)), 4) == [  # decode-only (MIX-17)
        tuple(expected[1][1:4]), tuple(expected[0][4:6])]
