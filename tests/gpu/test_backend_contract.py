"""The backend contract, run against every available backend (cpu, fake; cuda on a GPU).

Covers: FIFO stream order and per-launch output copies (architecture: *Two frame slots*,
OPEN-40), the execution timing record on every completion (DUR-14, DUR-15, OPEN-21),
fault isolation, preparation order and report (MIX-39, MIX-48, MIX-49), clean close,
and that waiting never blocks trio.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import trio
from backend_toys import (
    GatedProgram,
    MatmulCounter,
    ModeRecorder,
    RecordingProgram,
    SlowProgram,
    ToyFault,
    decode_shape,
    prefill_shape,
)

from gpu.backends import open_backend
from gpu.backends.cpu import CpuBackend
from gpu.backends.protocol import (
    Backend,
    BackendClosed,
    BackendError,
    BackendUnavailable,
    LaunchHandle,
    ProgramFault,
    ProgramNotPrepared,
)
from gpu.preparation import PreparationReport, ShapePreparation

WAIT_S = 30.0

BACKENDS = [
    pytest.param(("cpu", {}), id="cpu"),
    pytest.param(("cpu", {"device_process": False}), id="cpu-thread"),
    pytest.param(("fake", {}), id="fake"),
    pytest.param(("cuda", {}), id="cuda", marks=pytest.mark.cuda),
]
CPU_STREAMS = [pytest.param(True, id="device-process"), pytest.param(False, id="thread")]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name, options = request.param
    opened = open_backend(name, **options)
    try:
        yield opened
    finally:
        opened.close()


def _x(value: float, rows: int = 2) -> np.ndarray:
    return np.full((rows, 4), value, dtype=np.float32)


def _expected_y(program: MatmulCounter, value: float) -> torch.Tensor:
    return torch.as_tensor(_x(value, program.x.shape[0])) @ program.weight.cpu()


def _prepare(backend: Backend, program: MatmulCounter) -> None:
    """Prepare, then reset the execution counter: preparation may execute the program
    (CUDA warm-up), and the tests count launches only."""
    backend.prepare([program])
    program.counter.zero_()
    if backend.name == "cuda":
        torch.cuda.synchronize()


def _finished(handle: LaunchHandle) -> LaunchHandle:
    assert handle.wait(WAIT_S), "launch did not finish in time"
    return handle


def test_fifo_order_and_per_launch_outputs(backend: Backend) -> None:
    """Launches run bind->execute->read_outputs in FIFO order; each completion keeps
    its own outputs after later launches (architecture: one stream, OPEN-40)."""
    program = MatmulCounter(decode_shape(2), device=backend.device)
    _prepare(backend, program)
    handles = [backend.launch(program, {"x": _x(float(i))}) for i in range(6)]
    assert [h.sequence for h in handles] == list(range(6))
    completions = [_finished(h).result() for h in handles]
    assert [c.outputs["counter"] for c in completions] == [1, 2, 3, 4, 5, 6]
    for i, completion in enumerate(completions):
        assert completion.shape == program.shape
        torch.testing.assert_close(completion.outputs["y"], _expected_y(program, float(i)))
    # Mutating the program's buffers now must not reach earlier outputs.
    program.y.fill_(-1.0)
    torch.testing.assert_close(completions[0].outputs["y"], _expected_y(program, 0.0))


def test_timing_fields_are_valid(backend: Backend) -> None:
    """Every completion carries one positive device interval, a wall interval no
    shorter than it, and readiness delay 0 (DUR-14, DUR-15, OPEN-21)."""
    program = MatmulCounter(prefill_shape(64), device=backend.device)
    _prepare(backend, program)
    timing = _finished(backend.launch(program, {"x": _x(1.0, 64)})).result().timing
    assert len(timing.device_intervals_ns) == 1
    assert timing.device_ns > 0
    assert timing.wall_ns >= timing.device_ns
    assert timing.readiness_delay_ns == 0
    assert timing.cost_sample_ns == timing.device_ns


def test_fault_fails_only_its_launch(backend: Backend) -> None:
    """A program raising in bind, execute or read_outputs fails only that launch with
    ProgramFault carrying the cause; the stream keeps serving later launches."""
    program = MatmulCounter(decode_shape(2), device=backend.device)
    _prepare(backend, program)
    # A captured graph replays without calling Python's execute(), so on cuda only
    # bind and read_outputs can raise from Python.
    stages = ("bind", "read_outputs") if backend.name == "cuda" else (
        "bind", "execute", "read_outputs")
    first = backend.launch(program, {"x": _x(1.0)})
    faulty = [backend.launch(program, {"x": _x(2.0), "fail_in": stage}) for stage in stages]
    after = backend.launch(program, {"x": _x(3.0)})
    assert _finished(first).result().outputs["counter"] == 1
    for handle, stage in zip(faulty, stages, strict=True):
        with pytest.raises(ProgramFault) as info:
            _finished(handle).result()
        assert info.value.stage == stage
        assert isinstance(info.value.cause, ToyFault)
        assert info.value.__cause__ is info.value.cause
        assert program.shape.label() in str(info.value)
    result = _finished(after).result()
    torch.testing.assert_close(result.outputs["y"], _expected_y(program, 3.0))


def test_unprepared_program_is_refused(backend: Backend) -> None:
    prepared = MatmulCounter(decode_shape(1), device=backend.device)
    stranger = MatmulCounter(decode_shape(2), device=backend.device)
    backend.prepare([prepared])
    with pytest.raises(ProgramNotPrepared, match=r"decode\[B=2\]"):
        backend.launch(stranger, {"x": _x(1.0)})


def test_prepare_reports_largest_first_with_progress(backend: Backend) -> None:
    """Preparation goes largest first and reports the catalog it prepared and its
    maximum packed extent (MIX-39, MIX-48, MIX-49)."""
    programs = [MatmulCounter(s, device=backend.device)
                for s in (decode_shape(1), prefill_shape(128), decode_shape(4), prefill_shape(64))]

    events: list[tuple[str, object]] = []

    class Recorder:
        def started(self, name: str, total: int) -> None:
            events.append(("started", total))

        def shape_prepared(self, index: int, total: int, prepared: ShapePreparation) -> None:
            events.append(("shape", prepared.shape.label()))

        def finished(self, report: PreparationReport) -> None:
            events.append(("finished", len(report.shapes)))

    report = backend.prepare(programs, progress=Recorder())
    order = [s.label() for s in report.catalog]
    assert order == ["prefill[C=128]", "prefill[C=64]", "decode[B=4]", "decode[B=1]"]
    assert events == [("started", 4), *[("shape", label) for label in order], ("finished", 4)]
    assert report.max_packed_extent == 128
    assert report.backend == backend.name
    assert set(report.to_json()) >= {"shapes", "max_packed_extent", "headroom_bytes"}


def test_duplicate_shapes_are_refused(backend: Backend) -> None:
    a = MatmulCounter(decode_shape(2), device=backend.device)
    b = MatmulCounter(decode_shape(2), device=backend.device)
    with pytest.raises(ValueError, match="duplicate"):
        backend.prepare([a, b])


def test_close_is_clean(backend: Backend) -> None:
    """close() lets finished work stand, refuses new launches, and is idempotent."""
    program = MatmulCounter(decode_shape(1), device=backend.device)
    _prepare(backend, program)
    handle = backend.launch(program, {"x": _x(1.0, 1)})
    assert _finished(handle).result().outputs["counter"] == 1
    backend.close()
    backend.close()
    with pytest.raises(BackendClosed):
        backend.launch(program, {"x": _x(1.0, 1)})


def test_done_callback_runs_once(backend: Backend) -> None:
    program = MatmulCounter(decode_shape(1), device=backend.device)
    _prepare(backend, program)
    seen: list[int] = []
    handle = backend.launch(program, {"x": _x(1.0, 1)})
    handle.add_done_callback(lambda h: seen.append(h.sequence))
    _finished(handle)
    late: list[int] = []
    handle.add_done_callback(lambda h: late.append(h.sequence))
    assert late == [handle.sequence]
    assert seen == [handle.sequence]  # wait() returns only after callbacks ran


async def test_waiting_does_not_block_trio(backend: Backend) -> None:
    """The runtime waits through trio.to_thread; other trio tasks keep running."""
    program = MatmulCounter(decode_shape(1), device=backend.device)
    _prepare(backend, program)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            handles = [backend.launch(program, {"x": _x(float(i), 1)}) for i in range(3)]
            for handle in handles:
                assert await trio.to_thread.run_sync(handle.wait, WAIT_S)
            nursery.cancel_scope.cancel()
    assert [h.result().outputs["counter"] for h in handles] == [1, 2, 3]
    assert ticks > 0


# -- cpu stream semantics (a host-blocking toy cannot be captured on a GPU) -------


def test_cpu_queued_launch_starts_when_previous_ends() -> None:
    """A launch queued behind another starts only once the first has ended, and
    launch() itself never waits for the program (architecture: FIFO worker). The
    gate is a thread event, so the stream runs in this process."""
    backend = open_backend("cpu", device_process=False)
    try:
        gated = GatedProgram(decode_shape(1))
        follower = RecordingProgram(decode_shape(2))
        backend.prepare([gated, follower])
        first = backend.launch(gated, {"x": _x(1.0, 1)})
        second = backend.launch(follower, {"x": _x(2.0)})
        assert gated.entered.wait(WAIT_S)
        assert not first.done() and not second.done()
        assert not first.wait(0.05)
        gated.gate.set()
        assert _finished(second).result().outputs["counter"] == 1
        assert first.done()
        assert follower.execute_spans[0][0] >= gated.execute_spans[0][1]
    finally:
        backend.close()


@pytest.mark.parametrize("device_process", CPU_STREAMS)
def test_cpu_device_interval_measures_execute_only(device_process: bool) -> None:
    """The CPU device interval covers execute; the wall interval also covers bind and
    the wait in the queue (DUR-14)."""
    backend = open_backend("cpu", device_process=device_process)
    try:
        program = SlowProgram(decode_shape(1), bind_s=0.02, execute_s=0.03)
        _prepare(backend, program)
        timing = _finished(backend.launch(program, {"x": _x(1.0, 1)})).result().timing
        assert timing.device_ns >= 30_000_000
        assert timing.wall_ns >= timing.device_ns + 20_000_000
    finally:
        backend.close()


@pytest.mark.parametrize("device_process", CPU_STREAMS)
def test_cpu_launches_run_in_inference_mode(device_process: bool) -> None:
    """Staging, bind and execute run under ``torch.inference_mode`` (fewer dispatcher
    layers per op than ``no_grad``: ``gpu.backends.cpu``, *Dispatch*). Staging runs in
    the launching process on the thread stream, in the device process otherwise."""
    backend = open_backend("cpu", device_process=device_process)
    try:
        program = ModeRecorder(decode_shape(1))
        _prepare(backend, program)
        outputs = _finished(backend.launch(program, {"x": _x(1.0, 1)})).result().outputs
        assert outputs["modes"] == {"stage": True, "bind": True, "execute": True}
        assert torch.equal(outputs["y"], _expected_y(program, 1.0))
    finally:
        backend.close()


def test_cpu_close_drains_queued_launches() -> None:
    backend = CpuBackend()
    program = MatmulCounter(decode_shape(1))
    _prepare(backend, program)
    handles = [backend.launch(program, {"x": _x(float(i), 1)}) for i in range(4)]
    backend.close()
    assert all(h.done() for h in handles)
    assert [h.result().outputs["counter"] for h in handles] == [1, 2, 3, 4]
    assert backend.stream_name not in {t.name for t in threading.enumerate()}


def test_result_before_done_is_an_error() -> None:
    backend = open_backend("fake", auto_complete=False)
    program = MatmulCounter(decode_shape(1))
    _prepare(backend, program)
    handle = backend.launch(program, {"x": _x(1.0, 1)})
    with pytest.raises(BackendError, match="before the launch finished"):
        handle.result()
    backend.close()


def test_open_backend_unknown_name() -> None:
    with pytest.raises(BackendUnavailable, match="unknown backend 'tpu'"):
        open_backend("tpu")


def test_cuda_unavailable_is_a_clear_error() -> None:
    """Without a usable GPU, selecting cuda fails with the probe's reason; nothing
    crashes at import."""
    import gpu.backends.cuda  # noqa: F401  (importing must be safe anywhere)
    from gpu.backends.cuda_probe import probe_cuda

    probe = probe_cuda()
    if probe.available:
        pytest.skip("a CUDA device is present")
    assert probe.count == 0 or probe.reason
    with pytest.raises(BackendUnavailable, match=r"^cuda: no CUDA device \(.+\)"):
        open_backend("cuda")


# -- cpu intra-op threads --------------------------------------------------------


def test_cpu_threads_default_leaves_a_core_and_is_configurable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Default: usable cores minus one (at least one); ``FLARE_CPU_THREADS`` and
    ``num_threads`` override; 0 keeps torch's setting."""
    import torch

    from gpu.backends.cpu import THREADS_ENV, default_cpu_threads

    previous = torch.get_num_threads()
    try:
        monkeypatch.delenv(THREADS_ENV, raising=False)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
        assert default_cpu_threads() == 1
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
        assert default_cpu_threads() == 7
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
        assert default_cpu_threads() == 1
        monkeypatch.setenv(THREADS_ENV, "2")
        assert default_cpu_threads() == 2
        with CpuBackend() as backend:
            assert backend.num_threads == torch.get_num_threads() == 2
        with CpuBackend(num_threads=1) as backend:
            assert backend.num_threads == 1
        torch.set_num_threads(2)
        with CpuBackend(num_threads=0) as backend:
            assert backend.num_threads == 2
        monkeypatch.setenv(THREADS_ENV, "many")
        with pytest.raises(ValueError, match=THREADS_ENV):
            default_cpu_threads()
    finally:
        torch.set_num_threads(previous)
