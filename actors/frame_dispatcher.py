"""frame-dispatcher: launches committed frames on the backend stream and observes them.

Architecture step 4. The planner sends a ``FrameOrder`` whose host inputs are already
``gpu.frames`` values; the dispatcher launches the order's program (the backend binds
the inputs into the program's static buffers in stream order), then hands the launch
to its observer task, which waits for completions in FIFO order without blocking
trio: the handle's done-callback, run on the backend's completing thread, wakes the
observer through ``TrioToken.run_sync_soon`` (one thread hop from the device to trio;
a waiter thread per launch cost a second hop, ~0.5 ms on every window drain), and
cancellation simply stops waiting (house style 8).

The outcome (completion or ``ProgramFault``) and the host wall time from launch to
observed completion go to the completion-validator. A launch that raises at once
(``BackendClosed``, ``ProgramNotPrepared``, a bind-time ``FrameError`` raised
synchronously) becomes a fault outcome for that frame only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import trio

from actors.messages import DispatcherInbox, FrameOrder, FrameOutcome, ValidatorInbox
from gpu import FRAME_KEY, Backend, BackendError, LaunchHandle, PreparedProgram, ProgramFault
from policy import GraphShape

IN_FLIGHT_BUFFER = 2
"""Launched frames awaiting observation: the transport's two frame slots (QUEUE-10)."""


async def _wait(handle: LaunchHandle) -> None:
    """Until ``handle`` finishes, woken from the completing thread."""
    finished = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def wake(_: LaunchHandle) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the runtime is gone
            token.run_sync_soon(finished.set)

    handle.add_done_callback(wake)
    await finished.wait()


async def _observe(
    launched: trio.MemoryReceiveChannel[tuple[FrameOrder, LaunchHandle | None,
                                              ProgramFault | None, int]],
    to_validator: trio.MemorySendChannel[ValidatorInbox],
    clock_ns: Callable[[], int],
) -> None:
    async with launched, to_validator:
        async for order, handle, immediate_fault, launched_ns in launched:
            completion = None
            fault = immediate_fault
            if handle is not None:
                if not handle.done():
                    await _wait(handle)
                try:
                    completion = handle.result()
                except ProgramFault as exc:
                    fault = exc
            await to_validator.send(FrameOutcome(
                order=order, completion=completion, fault=fault,
                wall_ns=max(clock_ns() - launched_ns, 0), launched_ns=launched_ns,
            ))


async def run(
    inbox: trio.MemoryReceiveChannel[DispatcherInbox],
    to_validator: trio.MemorySendChannel[ValidatorInbox],
    *,
    backend: Backend,
    programs: Mapping[GraphShape, PreparedProgram],
    clock_ns: Callable[[], int],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Launch orders until the planner closes the inbox, then let the observer drain."""
    send_launched, receive_launched = trio.open_memory_channel[
        tuple[FrameOrder, LaunchHandle | None, ProgramFault | None, int]
    ](IN_FLIGHT_BUFFER)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_observe, receive_launched, to_validator, clock_ns)
        task_status.started()
        async with inbox, send_launched:
            async for order in inbox:
                program = programs[order.plan.shape]
                launched_ns = clock_ns()
                try:
                    handle = backend.launch(program, {FRAME_KEY: order.frame})
                except (BackendError, ValueError) as exc:
                    fault = ProgramFault(order.plan.shape, "launch", exc)
                    await send_launched.send((order, None, fault, launched_ns))
                    continue
                await send_launched.send((order, handle, None, launched_ns))
