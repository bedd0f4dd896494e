"""The runtime on the CPU backend's device process: killing the process mid-load
fails every request with an error naming the lost device, new requests fail the same
way instead of hanging, the runtime reports the fault (what ``/health`` reads), and
shutdown stays clean (``gpu.backends.cpu_process``)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import trio

from actors.public import Finished, GenerationRequest, SamplingParams, TokenDelta
from actors.system import Runtime, open_runtime
from tests.actors.test_runtime_cpu import config_for, prompt_of

DEADLINE_S = 60.0
GREEDY = SamplingParams(temperature=0.0)


def device_processes() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children()
            if p.name.startswith("flare-cpu-device-")]


async def run_request(rt: Runtime, prompt: list[int], max_tokens: int,
                      first_token: trio.Event | None = None) -> tuple[int, Finished]:
    tokens = 0
    request = GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=max_tokens,
                                sampling=GREEDY, ignore_eos=True)
    async with rt.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                tokens += len(event.token_ids)
                if first_token is not None:
                    first_token.set()
            elif isinstance(event, Finished):
                return tokens, event
    raise AssertionError("the stream ended without Finished")


async def test_killed_device_process_fails_requests_and_shuts_down_cleanly(
        tiny_llama: Path) -> None:
    before = {p.pid for p in device_processes()}
    outcomes: dict[int, tuple[int, Finished]] = {}
    with trio.fail_after(DEADLINE_S):
        async with open_runtime(config_for(tiny_llama, capture_forward=False)) as rt:
            (device,) = [p for p in device_processes() if p.pid not in before]
            assert rt.device_fault is None
            first_token = trio.Event()

            async def one(i: int) -> None:
                outcomes[i] = await run_request(rt, prompt_of(8, i), 200, first_token)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
                await first_token.wait()  # mid-load: frames are in flight
                assert device.pid is not None
                os.kill(device.pid, signal.SIGKILL)
            fault = rt.device_fault
            assert fault is not None and "SIGKILL" in fault
            # a request admitted after the loss fails too, instead of waiting forever
            late_tokens, late = await run_request(rt, prompt_of(8, 9), 4)
    for produced, finished in outcomes.values():
        assert finished.reason == "error"
        assert "device process" in finished.message and "SIGKILL" in finished.message
        assert produced < 200
    assert late.reason == "error" and "device process" in late.message
    assert late_tokens == 0
    assert not device.is_alive()
    assert [p for p in device_processes() if p.pid not in before] == []


async def test_close_joins_the_device_process(tiny_llama: Path) -> None:
    """A runtime that served a request leaves no device process behind."""
    before = {p.pid for p in device_processes()}
    with trio.fail_after(DEADLINE_S):
        async with open_runtime(config_for(tiny_llama, capture_forward=False)) as rt:
            (device,) = [p for p in device_processes() if p.pid not in before]
            tokens, finished = await run_request(rt, prompt_of(8, 1), 4)
    assert (tokens, finished.reason) == (4, "length")
    assert device.exitcode == 0
