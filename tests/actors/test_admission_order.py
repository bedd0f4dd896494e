"""The admission order (``--admission-order``, ``policy.admission_order``): FIFO, or
least slack (arrival minus the prompt's pure prefill time), in admission's queue, in
the runtime's prefill estimates, in ``flare run``'s flags and end to end on the toy
runtime."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import structlog
import structlog.testing
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.admission import AdmissionLimits, AdmissionState
from actors.config import ConfigError, RuntimeConfig
from actors.messages import Admit, Grant
from actors.policy_setup import admission_prefill
from actors.public import GenerationRequest
from ops import cli
from ops.run_command import build_runtime_config
from policy import GraphKind, GraphShape, Scheduler, pure_prefill_ns
from tests.actors.toy import request, toy_runtime, until

MS = 1_000_000
PREFILL_64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
PREFILL_256 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=256)
DECODE_1 = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1,
                      packed_capacity=1)


def admit(name: str, prompt_tokens: int, arrived_ns: int | None) -> Admit:
    events, _events = trio.open_memory_channel[object](1)
    decision, _decision = trio.open_memory_channel[object](1)
    return Admit(request_id=name,  # type: ignore[arg-type]
                 request=GenerationRequest(prompt_token_ids=(1,) * prompt_tokens, max_tokens=2),
                 events=events, decision=decision,  # type: ignore[arg-type]
                 arrived_ns=arrived_ns)


def queue(prefill_ns: Callable[[int], float | None] | None,
          max_queue: int = 8) -> AdmissionState:
    return AdmissionState(AdmissionLimits(max_context=4096, vocab_size=100,
                                          max_queue=max_queue), prefill_ns=prefill_ns)


def waiting(state: AdmissionState) -> list[str]:
    return [str(m.request_id) for m in state.waiting]


def per_token(prompt_tokens: int) -> float:
    return 10_000.0 * prompt_tokens  # 10 us a prompt token


def test_fifo_keeps_arrival_order() -> None:
    state = queue(None)
    for msg in (admit("short", 10, 1 * MS), admit("long", 1000, 2 * MS)):
        assert state.on_admit(msg) is None
    assert waiting(state) == ["short", "long"]


def test_least_slack_puts_a_long_prompt_before_shorter_ones_that_came_just_before() -> None:
    """Keys (arrival - prefill): short 1 - 0.1 = 0.9 ms; long at 2 ms with 1000 tokens
    (10 ms) -8 ms; the same long prompt at 20 ms: 10 ms, after both shorts (0.9, 4.9)."""
    state = queue(per_token)
    for msg in (admit("short", 10, 1 * MS), admit("long", 1000, 2 * MS),
                admit("later short", 10, 5 * MS), admit("late long", 1000, 20 * MS)):
        assert state.on_admit(msg) is None
    assert waiting(state) == ["long", "short", "later short", "late long"]
    assert state.reordered == 1


def parked(state: AdmissionState) -> str:
    send, _receive = trio.open_memory_channel[Grant | None](1)
    acquire = state.acquire_for_head(send)
    assert acquire is not None
    return str(acquire.request_id)


def test_a_request_that_goes_first_displaces_the_parked_head_once() -> None:
    """The head parked at the allocator stays first in ``waiting`` while its
    ``Acquire`` is cancelled (``take_displaced``, once); refused, it goes back to its
    place by key (short 0.9 ms, after long -8 ms, before next 2.9 ms)."""
    state = queue(per_token)
    assert state.on_admit(admit("short", 10, 1 * MS)) is None
    assert parked(state) == "short"
    assert state.on_admit(admit("next", 10, 3 * MS)) is None
    assert state.take_displaced() is None  # next goes after short: nothing to cancel
    assert state.on_admit(admit("long", 1000, 2 * MS)) is None
    assert state.on_admit(admit("longer", 2000, 2 * MS)) is None
    assert waiting(state) == ["short", "longer", "long", "next"]
    assert state.take_displaced() == "short" and state.take_displaced() is None
    assert state.on_grant(None) == (None, None)
    assert waiting(state) == ["longer", "long", "short", "next"]
    assert state.reordered == 2  # long and longer; next and the re-queued head are not
    assert parked(state) == "longer"
    assert state.on_withdraw("long") == "queued"  # type: ignore[arg-type]
    assert waiting(state) == ["longer", "short", "next"]


def test_a_displaced_head_granted_before_the_cancel_is_admitted() -> None:
    state = queue(per_token)
    assert state.on_admit(admit("short", 10, 1 * MS)) is None
    assert parked(state) == "short"
    assert state.on_admit(admit("long", 1000, 2 * MS)) is None
    assert state.take_displaced() == "short"
    grant = object()
    admitted, returned = state.on_grant(grant)  # type: ignore[arg-type]
    assert admitted is not None and admitted.request_id == "short" and returned is grant
    assert waiting(state) == ["long"] and not state.head_displaced


def test_without_an_estimate_or_an_arrival_time_a_request_queues_fifo() -> None:
    state = queue(lambda tokens: None)
    for msg in (admit("short", 10, 1 * MS), admit("long", 1000, 2 * MS)):
        assert state.on_admit(msg) is None
    assert waiting(state) == ["short", "long"]
    state = queue(per_token)
    for msg in (admit("short", 10, 1 * MS), admit("long", 1000, None)):
        assert state.on_admit(msg) is None
    assert waiting(state) == ["short", "long"]


def test_the_runtime_reads_pure_prefill_times_from_the_current_estimates() -> None:
    catalog = (PREFILL_64, PREFILL_256, DECODE_1)
    scheduler = Scheduler(catalog=catalog)
    assert admission_prefill("fifo", scheduler, catalog) is None
    prefill = admission_prefill("least-slack", scheduler, catalog)
    assert prefill is not None and prefill(300) is None  # nothing measured yet
    scheduler.estimates.observe(PREFILL_64, 2 * MS, 0)
    assert prefill(300) == 5 * 2 * MS
    scheduler.estimates.observe(PREFILL_256, 3 * MS, 0)
    assert prefill(300) == 2 * 3 * MS
    assert prefill(300) == pure_prefill_ns(300, [(64, 2 * MS), (256, 3 * MS)])


def test_flare_run_takes_the_order_and_refuses_another() -> None:
    argv = ["run", "--admission-order", "least-slack"]
    args = cli.build_parser(argv).parse_args(argv)
    assert build_runtime_config(args).admission_order == "least-slack"
    with pytest.raises(ConfigError, match="--admission-order"):
        RuntimeConfig(admission_order="random").validate()


@pytest.mark.parametrize(("order", "expected"), [("fifo", ["short", "long"]),
                                                 ("least-slack", ["long", "short"])])
async def test_the_runtime_admits_in_the_chosen_order(
        autojump_clock: trio.testing.MockClock, order: str, expected: list[str]) -> None:
    """One state row: while the first request runs, a 2-token prompt and then a
    100-token one (two 64-token chunks, one more prefill than the short one) wait. The
    row goes to the long prompt first under least slack: it arrived less than one
    chunk's time (4 ms) after the short one."""
    finished: list[str] = []
    with structlog.testing.capture_logs() as logs:
        reordered = await _three_requests(order, finished)
    assert finished == ["first", *expected]
    assert reordered == (order == "least-slack")
    logged = [e for e in logs if e["event"] == "admission.reordered"]
    assert len(logged) == (order == "least-slack")


async def _three_requests(order: str, finished: list[str]) -> int:
    """The three requests; returns ``statistics().admission_reordered``."""
    async with toy_runtime(state_rows=1, admission_order=order, timed=True) as toy:

        async def run(name: str, prompt: list[int]) -> None:
            async with toy.runtime.generate(request(prompt, 3)) as events:
                async for _ in events:
                    pass
            finished.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "first", [1, 2])
            await until(lambda: toy.runtime.statistics().prompt_tokens_total > 0)
            nursery.start_soon(run, "short", [3, 4])
            await until(lambda: toy.runtime.statistics().requests_waiting == 1)
            nursery.start_soon(run, "long", [3 + i % 30 for i in range(100)])
            await until(lambda: toy.runtime.statistics().requests_waiting == 2)
        return toy.runtime.statistics().admission_reordered


OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "park", "answer", "withdraw"]),
                         st.integers(1, 3000), st.integers(0, 5), st.booleans()),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_least_slack_admission_loses_and_leaks_nothing(ops: list[tuple[str, int, int,
                                                                        bool]]) -> None:
    """Random arrivals, parks, allocator answers and withdrawals: every accepted request
    is admitted once, dropped once or still waiting; behind the parked head the queue
    stays sorted by key; a head neither displaced nor withdrawn has the smallest key;
    no key outlives its request. An answer to a cancelled ``Acquire`` may still be a
    grant (the race with ``CancelAcquire``)."""
    state = queue(per_token, max_queue=64)
    keys = state._keys  # the leak check reads the queue's own keys
    now, names, live, done = 0, 0, set(), set()
    cancelled = False
    for op, tokens, pick, granted in ops:
        now += tokens * 100  # each step 0.1 us a token: arrivals close enough to pass
        if op == "admit":
            names += 1
            assert state.on_admit(admit(f"r{names}", tokens, now)) is None
            live.add(f"r{names}")
        elif op == "park" and not state.head_parked and state.waiting:
            parked(state)
            cancelled = False
        elif op == "answer" and state.head_parked:
            head = str(state.waiting[0].request_id)
            grant = object() if granted or not (cancelled or state.head_withdrawn) else None
            withdrawn = state.head_withdrawn
            admitted, returned = state.on_grant(grant)  # type: ignore[arg-type]
            if admitted is not None:
                assert str(admitted.request_id) == head and not withdrawn
                live.discard(head)
                done.add(head)
            elif withdrawn:
                live.discard(head)
                assert returned is grant
            else:
                assert grant is None and head in waiting(state)
        elif op == "withdraw" and live:
            name = sorted(live)[pick % len(live)]
            if state.on_withdraw(name) == "queued":  # type: ignore[arg-type]
                live.discard(name)
        displaced = state.take_displaced()
        if displaced is not None:
            assert state.head_parked and displaced == str(state.waiting[0].request_id)
            cancelled = True
        ids = waiting(state)
        assert len(ids) == len(set(ids)) and set(ids) == live and not live & done
        assert set(keys) == live
        first = 1 if state.head_parked else 0
        rest = [keys[i] for i in ids[first:]]
        assert rest == sorted(rest)
        if state.head_parked and not (state.head_displaced or state.head_withdrawn) and rest:
            assert keys[ids[0]] <= rest[0]
