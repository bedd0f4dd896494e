"""The planner keeps the two-slot window fed in speculative mode (fake backend, trio's
autojump clock).

With ``--speculation adaptive`` and complete speculative programs loaded (measured, and
too slow to win), the planner queues an ordinary decode behind a decode exactly as in
ordinary mode (QUEUE-10, QUEUE-11), and it never plans while the scheduler's window
takes nothing more: both slots full, an overrun (QUEUE-39) or a tail needing feedback
(QUEUE-12). Planning then would only cost host time the next frame waits for.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio
import trio.testing

from actors.public import StreamEvent, TokenDelta
from actors.system import RuntimeParts, open_runtime_with
from gpu.backends.fake import FakeBackend
from policy.config import PolicyConfig
from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.frame_queue import FRAME_SLOTS
from policy.scheduler import Scheduler
from policy.types import ScheduledPlan
from tests.actors.toy import (
    EOS,
    TOY_DEADLINE_S,
    VOCAB,
    ToyCodec,
    ToyDevice,
    ToyProgram,
    ToySystem,
    reference_output,
    request,
    toy_catalog,
    toy_durations,
    until,
)

Clock = trio.testing.MockClock
MS = 1_000_000
SPECULATIVE = tuple(
    GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
               proposal_depth=w - 1, packed_capacity=b * w, binding=TargetBinding.QUERY_LENGTH)
    for b in (1, 2, 4) for w in (1, 2, 3))
"""Complete speculative programs; measured at 50 ms, so an ordinary decode (about 1 ms)
always wins, and the toy never has to run one (a toy program raises if it does)."""


@contextlib.asynccontextmanager
async def adaptive_toy() -> AsyncIterator[ToySystem]:
    """The toy runtime (``tests/actors/toy.py``) in adaptive speculative mode with copy
    proposals and ``SPECULATIVE`` loaded and measured; launches complete only when the
    test says so."""
    clock = lambda: int(trio.current_time() * 1e9)  # noqa: E731
    backend = FakeBackend(device_ns=toy_durations, auto_complete=False, clock_ns=clock)
    device = ToyDevice(page_size=4)
    catalog = (*toy_catalog(4), *SPECULATIVE)
    programs = {shape: ToyProgram(shape, device) for shape in catalog}
    backend.prepare(list(programs.values()))
    parts = RuntimeParts(
        backend=backend, programs=programs, codec=ToyCodec(), model_name="toy",
        vocab_size=VOCAB, eos_token_ids=(EOS,), max_context=256, page_size=4,
        num_pages=64, state_rows=4, max_queue=8, policy=PolicyConfig(), clock_ns=clock,
        speculation="adaptive", draft_source="copy",
    )
    with trio.fail_after(TOY_DEADLINE_S):
        async with open_runtime_with(parts, catalog=catalog) as runtime:
            scheduler = runtime.scheduler
            assert isinstance(scheduler, Scheduler) and scheduler.speculation is not None
            for shape in SPECULATIVE:
                scheduler.estimates.observe(shape, 50 * MS, scheduler.now_ns)
            yield ToySystem(runtime=runtime, backend=backend, device=device)


def watch_plans(scheduler: Scheduler) -> list[tuple[int, bool]]:
    """Record, for every ``plan()`` call, the frames in flight and whether the window was
    open at that moment."""
    seen: list[tuple[int, bool]] = []
    original: Callable[[], ScheduledPlan | None] = scheduler.plan

    def plan() -> ScheduledPlan | None:
        seen.append((len(scheduler.in_flight()), scheduler.window_open()))
        return original()

    scheduler.plan = plan  # type: ignore[method-assign]
    return seen


async def test_queue_10_11_adaptive_decode_queues_behind_decode_and_planner_waits(
        autojump_clock: Clock) -> None:
    """Covers QUEUE-10, QUEUE-11, QUEUE-39: two decode frames are outstanding at once in
    adaptive mode; the planner never plans while the window takes nothing more; the
    output is the reference output."""
    prompt = [1, 2, 3]
    async with adaptive_toy() as toy:
        scheduler = toy.runtime.scheduler
        assert isinstance(scheduler, Scheduler) and scheduler.speculation is not None
        seen = watch_plans(scheduler)
        results: list[list[StreamEvent]] = []
        depth: list[int] = []

        async def run() -> None:
            async with toy.runtime.generate(request(prompt, 40)) as events:
                results.append([event async for event in events])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while not results:
                try:
                    await until(lambda: bool(toy.backend.pending()) or bool(results),
                                limit=200)
                except AssertionError:
                    continue
                pending = toy.backend.pending()
                if not pending:
                    continue
                depth.append(len(pending))
                if len(pending) == 2:
                    assert all(h.shape.kind is GraphKind.DECODE for h in pending)
                toy.backend.complete_next()
        executed = dict(toy.runtime.statistics().executions_by_graph)
    tokens = [t for e in results[0] if isinstance(e, TokenDelta) for t in e.token_ids]
    assert tokens == reference_output(prompt, 40)
    assert max(depth) == FRAME_SLOTS  # decode behind decode (QUEUE-11)
    assert not any(label.startswith("spec") for label in executed), executed
    assert seen and all(in_flight < FRAME_SLOTS and window_open
                        for in_flight, window_open in seen), seen


async def test_queue_39_overrun_suspends_planning_until_completion(
        autojump_clock: Clock) -> None:
    """Covers QUEUE-39, QUEUE-40: a decode left running far past its expected end stops
    the planner from queueing (and planning); its completion resumes both."""
    async with adaptive_toy() as toy:
        scheduler = toy.runtime.scheduler
        assert isinstance(scheduler, Scheduler) and scheduler.speculation is not None
        seen = watch_plans(scheduler)
        results: list[Any] = []

        async def run() -> None:
            async with toy.runtime.generate(request([4, 5, 6], 12)) as events:
                results.append([event async for event in events])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            # Run the prefill and the first decode normally.
            for _ in range(3):
                await until(lambda: bool(toy.backend.pending()))
                toy.backend.complete_next()
            await until(lambda: bool(toy.backend.pending()))
            await trio.sleep(1.0)  # far past every expected end: an overrun
            assert not scheduler.window_open()
            calls = len(seen)
            await trio.sleep(1.0)
            assert len(seen) == calls  # no planning while nothing can be submitted
            while not results:
                await until(lambda: bool(toy.backend.pending()) or bool(results))
                if toy.backend.pending():
                    toy.backend.complete_next()
    tokens = [t for e in results[0] if isinstance(e, TokenDelta) for t in e.token_ids]
    assert tokens == reference_output([4, 5, 6], 12)


async def test_idle_device_gets_its_next_frame_before_publication(
        autojump_clock: Clock) -> None:
    """When a completion leaves no frame in flight (a prefill drains the window,
    QUEUE-12), the planner launches the next frame before it sends the completed
    frame's tokens to the publisher, so the device does not wait for publication;
    while another frame still runs, the tokens go first (ACCT-17 order unchanged)."""
    from actors.messages import FrameOrder, PublishFrame
    from tests.actors.toy import toy_runtime

    async with toy_runtime(timed=True) as toy:
        planner = toy.runtime._planner
        sends: list[tuple[str, int, int]] = []

        def observe(channel: Any, kind: type, name: str) -> None:
            original = channel.send

            async def send(message: Any) -> None:
                if isinstance(message, kind):
                    in_flight = len(planner.scheduler.in_flight())
                    sends.append((name, int(message.fence), in_flight))
                await original(message)

            channel.send = send

        complete = planner._complete_in_scheduler

        def observed_complete(frame: Any) -> Any:
            tokens = complete(frame)
            sends.append(("complete", int(frame.fence), len(planner.scheduler.in_flight())))
            return tokens

        planner._complete_in_scheduler = observed_complete
        observe(planner._to_publisher, PublishFrame, "publish")
        observe(planner._to_dispatcher, FrameOrder, "launch")
        async with toy.runtime.generate(request([1, 2, 3], 8)) as events:
            tokens = [t async for e in events if isinstance(e, TokenDelta)
                      for t in e.token_ids]
    assert tokens == reference_output([1, 2, 3], 8)
    completions = [i for i, (name, _, _) in enumerate(sends) if name == "complete"]
    assert len(completions) == 8, str(sends)  # a prefill and seven decodes
    idle = [i for i in completions if sends[i][2] == 0]
    busy = [i for i in completions if sends[i][2] > 0]
    assert idle and busy, sends  # the prefill drains the window (QUEUE-12)
    for i in idle:
        fence = sends[i][1]
        rest = [s for s in sends[i + 1:] if s[0] != "complete"]
        if rest and rest[0][0] == "launch":
            # the idle device got its next frame, then the tokens went out
            assert rest[1] == ("publish", fence, 1), sends
    for i in busy:
        fence = sends[i][1]
        assert sends[i + 1][:2] == ("publish", fence), sends  # tokens first
