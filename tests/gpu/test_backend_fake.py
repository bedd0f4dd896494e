"""The fake backend's scripting (manual completion, scripted timings and faults) and
the preparation progress sinks.

The fake keeps the contract (FIFO, ProgramFault isolation, ExecutionTiming with the
scripted device interval, DUR-14) while tests decide when launches finish; it works on
trio's autojump clock because nothing in it sleeps.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import trio
import trio.testing
from backend_toys import MatmulCounter, decode_shape, prefill_shape

from gpu.backends.fake import FakeBackend
from gpu.backends.protocol import BackendError, ProgramFault
from gpu.preparation import (
    LogLineProgress,
    TerminalProgressBar,
    default_progress,
    prepare_catalog,
)


def _x(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 4), value, dtype=np.float32)}


def test_manual_completion_in_fifo_order_with_scripted_intervals() -> None:
    small, large = MatmulCounter(decode_shape(1)), MatmulCounter(prefill_shape(64))
    backend = FakeBackend(auto_complete=False,
                          device_ns={small.shape: 2_000_000, large.shape: 9_000_000})
    backend.prepare([small, large])
    a = backend.launch(small, _x(1.0))
    b = backend.launch(large, _x(2.0, 64))
    assert backend.pending() == (a, b)
    assert not a.done() and not a.wait(0)
    assert backend.complete_next() is a
    assert a.result().timing.device_ns == 2_000_000
    assert not b.done()
    assert backend.complete_next(device_ns=7) is b
    assert b.result().timing.device_ns == 7
    assert b.result().timing.wall_ns >= 7
    assert [launch.handle for launch in backend.launches] == [a, b]
    with pytest.raises(BackendError, match="no queued launch"):
        backend.complete_next()


def test_scripted_faults_fail_only_their_launch() -> None:
    program = MatmulCounter(decode_shape(1))
    other = MatmulCounter(decode_shape(2))
    backend = FakeBackend(device_ns=lambda shape: 1000 * shape.batch_capacity)
    backend.prepare([program, other])
    backend.fault_next(ValueError("scripted"), shape=other.shape)
    ok = backend.launch(program, _x(1.0))
    bad = backend.launch(other, _x(1.0, 2))
    again = backend.launch(other, _x(1.0, 2))
    assert ok.result().timing.device_ns == 1000
    with pytest.raises(ProgramFault, match="scripted") as info:
        bad.result()
    assert isinstance(info.value.cause, ValueError)
    assert again.result().outputs["counter"] == 1  # the faulted launch never ran
    assert again.result().timing.device_ns == 2000


def test_fail_next_and_close_fail_pending_launches() -> None:
    program = MatmulCounter(decode_shape(1))
    backend = FakeBackend(auto_complete=False)
    backend.prepare([program])
    first, second = backend.launch(program, _x(1.0)), backend.launch(program, _x(2.0))
    assert backend.fail_next(RuntimeError("device lost")) is first
    with pytest.raises(ProgramFault, match="device lost"):
        first.result()
    backend.close()
    with pytest.raises(ProgramFault, match="backend closed"):
        second.result()


async def test_fake_backend_on_the_autojump_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A runtime-style wait (done callback -> trio) with completions driven by a task
    on virtual time; wall intervals follow the injected clock."""
    program = MatmulCounter(decode_shape(1))
    backend = FakeBackend(auto_complete=False, device_ns=3_000_000,
                          clock_ns=lambda: int(trio.current_time() * 1e9))
    backend.prepare([program])
    token = trio.lowlevel.current_trio_token()
    finished = trio.Event()
    handle = backend.launch(program, _x(1.0))
    handle.add_done_callback(lambda _h: token.run_sync_soon(finished.set))

    async def device() -> None:
        await trio.sleep(0.005)
        backend.complete_next()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(device)
        with trio.fail_after(1):
            await finished.wait()
    timing = handle.result().timing
    assert timing.device_ns == 3_000_000
    assert timing.wall_ns == pytest.approx(5_000_000, rel=0.01)


class _FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_and_log_lines_otherwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    programs = [MatmulCounter(decode_shape(1)), MatmulCounter(prefill_shape(64))]
    tty = _FakeTty()
    sink = default_progress(tty)
    assert isinstance(sink, TerminalProgressBar)
    report = prepare_catalog(FakeBackend(), programs, progress=sink)
    text = tty.getvalue()
    assert "\r" in text and "2/2" in text and "prefill[C=64]" in text
    assert report.summary() in text

    assert isinstance(default_progress(io.StringIO()), LogLineProgress)
    with caplog.at_level(logging.INFO, logger="flare.gpu.preparation"):
        prepare_catalog(FakeBackend(), programs, progress=LogLineProgress())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "event=preparation_started backend=fake shapes=2"
    assert lines[1].startswith("event=shape_prepared shape=prefill[C=64] index=1 total=2")
    assert lines[-1].startswith("event=preparation_finished 2 shapes on fake")
