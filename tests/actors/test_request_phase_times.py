"""Each ``Finished`` carries where its request's time went, on the runtime clock:
``queued_s`` (submission to the first frame serving it), ``prefill_s`` (to the first
output token) and ``decode_s`` (first to last token); checked in virtual time on the
toy device, whose frame durations are scripted (``toy_durations``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actors.public import Finished, StreamEvent
from actors.publisher import phase_times
from actors.system import Runtime
from policy.scheduler import Scheduler
from tests.actors.toy import request, toy_runtime

PREFILL_S = 0.004  # prefill[C=64]
DECODE_S = 0.00125  # decode[B=1]


async def timed_collect(rt: Runtime, prompt: list[int], max_tokens: int,
                        out: dict[int, tuple[Finished, float]]) -> None:
    start = trio.current_time()
    async with rt.generate(request(prompt, max_tokens, ignore_eos=True)) as events:
        final: list[StreamEvent] = [event async for event in events]
    assert isinstance(final[-1], Finished)
    out[prompt[0]] = (final[-1], trio.current_time() - start)


async def test_phase_times_of_a_served_and_a_queued_request(
        autojump_clock: trio.testing.MockClock) -> None:
    """With one state row the second request waits for the first to finish: its queue
    time covers the first's whole service, and its own phases are the scripted frames."""
    results: dict[int, tuple[Finished, float]] = {}
    async with toy_runtime(timed=True, state_rows=1, max_batch=1) as toy, \
            trio.open_nursery() as nursery:
        nursery.start_soon(timed_collect, toy.runtime, [1, 2, 3], 6, results)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(timed_collect, toy.runtime, [2, 3, 4], 6, results)
    (first, first_e2e), (second, second_e2e) = results[1], results[2]
    for final, e2e in ((first, first_e2e), (second, second_e2e)):
        assert final.prefill_s == pytest.approx(PREFILL_S, abs=5e-4)
        assert final.decode_s == pytest.approx(5 * DECODE_S, rel=0.25)
        assert final.queued_s is not None and final.queued_s >= 0
        assert final.queued_s + final.prefill_s + final.decode_s <= e2e + 1e-9
    assert first.queued_s == pytest.approx(0, abs=5e-4)
    assert second.queued_s >= first.prefill_s + first.decode_s  # type: ignore[operator]


async def test_the_scheduler_learns_when_a_queued_request_arrived(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner passes each request's arrival on the runtime clock to
    ``Scheduler.admit`` (the first-token urgency counts from it): the queued second
    request arrived at its submission, a whole service before it was admitted."""
    admitted: list[tuple[int | None, int]] = []
    admit = Scheduler.admit

    def spy(self: Scheduler, **kw: object) -> object:
        admitted.append((kw.get("arrived_ns"), self.now_ns))  # type: ignore[arg-type]
        return admit(self, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "admit", spy)
    results: dict[int, tuple[Finished, float]] = {}
    async with toy_runtime(timed=True, state_rows=1, max_batch=1) as toy, \
            trio.open_nursery() as nursery:
        nursery.start_soon(timed_collect, toy.runtime, [1, 2, 3], 6, results)
        await trio.testing.wait_all_tasks_blocked()
        submitted_ns = int(trio.current_time() * 1e9)
        nursery.start_soon(timed_collect, toy.runtime, [2, 3, 4], 6, results)
    (first_arrived, first_at), (second_arrived, second_at) = admitted
    assert first_arrived is not None and first_arrived <= first_at
    assert second_arrived == submitted_ns
    service_ns = (results[1][0].prefill_s + results[1][0].decode_s) * 1e9  # type: ignore[operator]
    assert second_at - second_arrived >= service_ns - 1


def test_phases_a_request_never_reached_are_none() -> None:
    """Never served by a frame: no phase at all; served but no output yet (cancelled
    during its prefill): a queue time only."""
    assert phase_times(5, None, None, None) == {
        "queued_s": None, "prefill_s": None, "decode_s": None}
    assert phase_times(1_000, 3_000, None, None) == {
        "queued_s": 2e-6, "prefill_s": None, "decode_s": None}
    assert phase_times(0, 1_000_000_000, 1_500_000_000, 4_000_000_000) == {
        "queued_s": 1.0, "prefill_s": 0.5, "decode_s": 2.5}
