"""Toy prepared programs for the backend contract tests (not model code).

``MatmulCounter`` computes ``y = x @ W`` into a static output buffer and bumps a
device-resident counter on every execution, so a test can see the order in which
launches ran and whether outputs are per-launch copies. It is capturable (static
shapes, ``out=`` writes, no host sync in ``execute``). ``SlowProgram`` adds host sleeps
inside bind and execute (CPU only) so timing lower bounds can be checked, and
``GatedProgram`` blocks ``execute`` until a test opens its gate (CPU only).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from policy.descriptors import GraphKind, GraphShape


def decode_shape(batch: int) -> GraphShape:
    return GraphShape(kind=GraphKind.DECODE, batch_capacity=batch, token_capacity=1)


def prefill_shape(capacity: int) -> GraphShape:
    return GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=capacity)


class ToyFault(RuntimeError):
    """What toy programs raise when asked to fail."""


class MatmulCounter:
    """``y = x @ W``; a counter buffer counts executions. Inputs: ``x`` (rows, 4) and
    optional ``fail_in`` naming a stage that should raise."""

    def __init__(self, shape: GraphShape, device: str = "cpu") -> None:
        self._shape = shape
        rows = shape.batch_capacity * shape.token_capacity
        self.weight = torch.arange(16, dtype=torch.float32, device=device).reshape(4, 4)
        self.x = torch.zeros(rows, 4, device=device)
        self.y = torch.zeros(rows, 4, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.execute_spans: list[tuple[int, int]] = []
        self._fail_in: str | None = None

    @property
    def shape(self) -> GraphShape:
        return self._shape

    def bind(self, inputs: Mapping[str, Any]) -> None:
        self._fail_in = inputs.get("fail_in")
        if self._fail_in == "bind":
            raise ToyFault("bind failed on request")
        self.x.copy_(torch.as_tensor(inputs["x"], dtype=torch.float32), non_blocking=True)

    def execute(self) -> None:
        if self._fail_in == "execute":
            raise ToyFault("execute failed on request")
        torch.matmul(self.x, self.weight, out=self.y)
        self.counter.add_(1)

    def read_outputs(self) -> dict[str, Any]:
        if self._fail_in == "read_outputs":
            raise ToyFault("read_outputs failed on request")
        return {"y": self.y.cpu().clone(), "counter": int(self.counter.cpu().item())}


class SlowProgram(MatmulCounter):
    """Sleeps ``bind_s`` in bind and ``execute_s`` in execute (a stand-in for work)."""

    def __init__(self, shape: GraphShape, *, bind_s: float, execute_s: float) -> None:
        super().__init__(shape)
        self.bind_s = bind_s
        self.execute_s = execute_s

    def bind(self, inputs: Mapping[str, Any]) -> None:
        time.sleep(self.bind_s)
        super().bind(inputs)

    def execute(self) -> None:
        start = time.perf_counter_ns()
        time.sleep(self.execute_s)
        super().execute()
        self.execute_spans.append((start, time.perf_counter_ns()))


class GatedProgram(MatmulCounter):
    """``execute`` blocks until ``gate`` is set; ``entered`` is set when it starts."""

    def __init__(self, shape: GraphShape) -> None:
        super().__init__(shape)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def execute(self) -> None:
        start = time.perf_counter_ns()
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise ToyFault("gate never opened")
        super().execute()
        self.execute_spans.append((start, time.perf_counter_ns()))


class RecordingProgram(MatmulCounter):
    """Records when its execute ran (for queue-order checks)."""

    def execute(self) -> None:
        start = time.perf_counter_ns()
        super().execute()
        self.execute_spans.append((start, time.perf_counter_ns()))


class ViewWriter(MatmulCounter):
    """Writes input ``v`` through a numpy view of its buffer made at construction (as
    the request state's ``host_views`` are) and reads the buffer back as a tensor; an
    input ``raise_unpicklable`` makes bind raise an exception that cannot be pickled."""

    def __init__(self, shape: GraphShape) -> None:
        super().__init__(shape)
        self.buffer = torch.zeros(4, dtype=torch.int64)
        self.view = self.buffer.numpy()[1:3]

    def bind(self, inputs: Mapping[str, Any]) -> None:
        if inputs.get("raise_unpicklable"):
            raise UnpicklableFault(threading.Lock())
        self.view[:] = inputs["v"]
        super().bind(inputs)

    def read_outputs(self) -> dict[str, Any]:
        return {**super().read_outputs(), "buffer": self.buffer.tolist()}


class UnpicklableFault(RuntimeError):
    """An exception whose argument (a lock) does not pickle."""


class UnpicklableOutput(MatmulCounter):
    """Returns an output that cannot be pickled (a lock) when asked to."""

    def read_outputs(self) -> dict[str, Any]:
        outputs = super().read_outputs()
        if self._fail_in == "pickle_outputs":
            outputs["lock"] = threading.Lock()
        return outputs


class ModeRecorder(MatmulCounter):
    """Reports whether its staging, bind and execute ran under ``torch.inference_mode``
    (outputs ``modes``: stage, bind, execute)."""

    def __init__(self, shape: GraphShape) -> None:
        super().__init__(shape)
        self.modes: dict[str, bool] = {}

    def stage(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        self.modes["stage"] = torch.is_inference_mode_enabled()
        return inputs

    def bind_staged(self, staged: Mapping[str, Any]) -> None:
        self.modes["bind"] = torch.is_inference_mode_enabled()
        super().bind(staged)

    def execute(self) -> None:
        self.modes["execute"] = torch.is_inference_mode_enabled()
        super().execute()

    def read_outputs(self) -> dict[str, Any]:
        return {**super().read_outputs(), "modes": dict(self.modes)}
