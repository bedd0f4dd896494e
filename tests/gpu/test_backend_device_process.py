"""The cpu backend's device process (``gpu.backends.cpu_process``): program buffers
and numpy views of them are shared with the serving process, an exception that does
not pickle still faults only its launch, close drains and joins, and a killed device
process fails the pending launches and refuses later ones with ``DeviceLost``."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from backend_toys import MatmulCounter, UnpicklableOutput, ViewWriter, decode_shape

from gpu.backends import open_backend
from gpu.backends.cpu_process import DeviceLost, DeviceProcessBackend
from gpu.backends.device_worker import RemoteFault
from gpu.backends.protocol import BackendError, LaunchHandle, ProgramFault

WAIT_S = 30.0


def _x() -> np.ndarray:
    return np.ones((1, 4), dtype=np.float32)


def _finished(handle: LaunchHandle) -> LaunchHandle:
    assert handle.wait(WAIT_S), "launch did not finish in time"
    return handle


def test_buffers_and_their_numpy_views_are_shared() -> None:
    """A write through a numpy view made before ``prepare`` lands in the buffer the
    device process reads and the serving process sees (views are not copied)."""
    backend = open_backend("cpu")
    assert isinstance(backend, DeviceProcessBackend)
    try:
        program = ViewWriter(decode_shape(1))
        backend.prepare([program])
        outputs = _finished(backend.launch(program, {"x": _x(), "v": [7, 9]})).result().outputs
        assert outputs["buffer"] == [0, 7, 9, 0]
        assert program.buffer.tolist() == [0, 7, 9, 0]  # the same pages in this process
        assert program.counter.item() == 1
    finally:
        backend.close()


def test_unpicklable_exception_faults_only_its_launch() -> None:
    backend = open_backend("cpu")
    try:
        program = ViewWriter(decode_shape(1))
        backend.prepare([program])
        bad = backend.launch(program, {"x": _x(), "raise_unpicklable": True})
        good = backend.launch(program, {"x": _x(), "v": [1, 2]})
        with pytest.raises(ProgramFault) as fault:
            _finished(bad).result()
        assert fault.value.stage == "bind"
        assert isinstance(fault.value.cause, RemoteFault)
        assert "UnpicklableFault" in str(fault.value.cause)
        assert _finished(good).result().outputs["buffer"] == [0, 1, 2, 0]
    finally:
        backend.close()


def test_inputs_or_outputs_that_do_not_pickle_fail_only_their_launch() -> None:
    """The transport pickles whatever a program takes and returns; what does not
    pickle fails that launch (at ``launch`` for inputs, as its fault for outputs)
    and the stream goes on."""
    backend = open_backend("cpu")
    try:
        program = UnpicklableOutput(decode_shape(1))
        backend.prepare([program])
        with pytest.raises(BackendError, match="could not be sent"):
            backend.launch(program, {"x": _x(), "hook": lambda: None})
        bad = backend.launch(program, {"x": _x(), "fail_in": "pickle_outputs"})
        good = backend.launch(program, {"x": _x()})
        with pytest.raises(ProgramFault, match="outputs could not be sent back") as fault:
            _finished(bad).result()
        assert fault.value.stage == "read_outputs"
        assert _finished(good).result().outputs["counter"] == 2
    finally:
        backend.close()


def test_close_drains_queued_launches_and_joins_the_process() -> None:
    backend = DeviceProcessBackend()
    program = MatmulCounter(decode_shape(1))
    backend.prepare([program])
    handles = [backend.launch(program, {"x": _x()}) for _ in range(4)]
    backend.close()
    assert [h.result().outputs["counter"] for h in handles] == [1, 2, 3, 4]
    assert backend._process.exitcode == 0
    assert backend.lost is None


def test_killed_process_fails_pending_launches_and_refuses_later_ones() -> None:
    backend = DeviceProcessBackend()
    try:
        program = MatmulCounter(decode_shape(1))
        backend.prepare([program])
        _finished(backend.launch(program, {"x": _x()}))
        assert backend.pid is not None
        os.kill(backend.pid, signal.SIGSTOP)  # hold it so launches stay pending
        pending = [backend.launch(program, {"x": _x()}) for _ in range(3)]
        os.kill(backend.pid, signal.SIGKILL)
        for handle in pending:
            with pytest.raises(ProgramFault) as fault:
                _finished(handle).result()
            assert fault.value.stage == "device"
            assert isinstance(fault.value.cause, DeviceLost)
            assert "killed by SIGKILL" in str(fault.value.cause)
        assert isinstance(backend.lost, DeviceLost)
        with pytest.raises(DeviceLost, match="SIGKILL"):
            backend.launch(program, {"x": _x()})
    finally:
        backend.close()


class _HoldsALambda(MatmulCounter):
    def __init__(self) -> None:
        super().__init__(decode_shape(1))
        self.hook = lambda: None


def test_a_program_that_does_not_pickle_is_a_clear_error() -> None:
    """A program holding what cannot move to another process fails ``prepare`` with
    the pickling error, and the device process started for it is gone."""
    backend = DeviceProcessBackend()
    try:
        with pytest.raises(Exception, match="pickle"):
            backend.prepare([_HoldsALambda()])
        assert not backend._process.is_alive()
    finally:
        backend.close()
