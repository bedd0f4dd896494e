"""The ``cpu`` backend's default stream: prepared programs run in a device process.

The CPU counterpart of a GPU stream. In one process the model's worker thread shares
the interpreter lock and the cores' caches with the HTTP server, the actors and the
planner, and every host step stretches the measured execution interval. Here each
stream is a separate process that owns execution (``gpu.backends.device_worker``):

- ``prepare(programs)`` starts the process (from torch.multiprocessing's
  ``forkserver`` context, a fresh interpreter with torch preloaded, never a fork of
  the serving process and its threads) and sends it the programs once. Their
  tensors move into shared memory in place (``gpu.backends.shared_pickling``): the
  weights, KV pool, request state and workspaces are the same pages in both
  processes, and nothing is copied. From then on the host's program objects are only
  identities: every ``stage``, ``bind``, ``execute`` and ``read_outputs`` runs in the
  device process, the host never touches their buffers.
- ``launch`` pickles ``(program index, inputs, sequence, launched_ns)`` onto the pipe
  and returns a ``LaunchHandle`` at once; the device process stages, binds, executes
  (measuring the interval there) and reads out in FIFO order.
- One reader thread per stream receives the completions, in launch order, and
  finishes the handles: their done-callbacks (the frame dispatcher's trio wake-up)
  run on it, so waiting costs no thread per launch. The wall interval runs from
  ``launch`` to that reader's receipt.

Death of the device process: the reader sees the pipe close, every pending launch
fails with a ``ProgramFault`` whose cause is ``DeviceLost`` (naming the exit status or
signal), and every later ``launch`` raises ``DeviceLost``; ``lost`` holds it for
health reports. ``close()`` lets queued launches finish, then joins the process and
kills it if it does not exit within ``CLOSE_TIMEOUT_S``.

Threads: the device process sets torch's intra-op pool (``default_cpu_threads()``,
``FLARE_CPU_THREADS`` or ``num_threads``); the serving process keeps one torch thread.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import pickle
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from gpu.backends import device_worker
from gpu.backends.cpu import default_cpu_threads
from gpu.backends.protocol import (
    BackendClosed,
    BackendError,
    Completion,
    LaunchHandle,
    ProgramFault,
    ProgramNotPrepared,
)
from gpu.backends.ranks import RENDEZVOUS_TIMEOUT_S, RankSpec
from gpu.backends.shared_pickling import dumps_shared
from gpu.preparation import PreparationReport, ProgressSink, prepare_in_order
from gpu.program import PreparedProgram

CLOSE_TIMEOUT_S = 30.0
"""How long ``close()`` waits for the device process to finish its queued launches
and exit before killing it (a frame is at most a few hundred ms on the CPU)."""

START_TIMEOUT_S = 120.0
"""How long ``prepare`` waits for the device process to map the programs (a rank of a
tensor-parallel group: to build its shard, plus the rendezvous's own wait)."""

EXIT_REPORT_S = 5.0
"""How long the reader waits for a vanished device process's exit status."""

_START_METHOD = "forkserver"
_stream_ids = itertools.count()


class DeviceLost(BackendError):
    """Raised (as the cause of a pending launch's ``ProgramFault``, and by every later
    ``launch``) once the device process has exited without being asked to; the
    message names its exit status or signal."""


def _context() -> Any:
    """The forkserver context, its server preloading torch and the device worker so
    each stream's process starts in tens of milliseconds instead of re-importing."""
    context = torch_mp.get_context(_START_METHOD)
    context.set_forkserver_preload(["torch", "gpu.backends.device_worker"])
    return context


def warm_up_start() -> None:
    """Start the forkserver (it imports torch: seconds, once per serving process) on a
    background thread, so it overlaps loading the model; ``prepare`` waits for it."""
    from multiprocessing import forkserver

    def start() -> None:
        _context()
        forkserver.ensure_running()

    threading.Thread(target=start, name="flare-forkserver-start", daemon=True).start()


def exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class DeviceProcessBackend:
    """The ``cpu`` backend with its stream in a device process (the default)."""

    name = "cpu"
    device = "cpu"
    resident_grammars = True
    """Each frame binds after the frame ahead executed, on this CPU, so the programs
    may hold grammar matchers per row (``gpu.grammar_rows``)."""

    def __init__(self, *, num_threads: int | None = None, rank: RankSpec | None = None,
                 dumps: Callable[[list[PreparedProgram]], bytes] | None = None) -> None:
        """``num_threads``: the device process's torch intra-op threads (``None``:
        ``default_cpu_threads()``; 0: torch's default there). ``rank``: the process is
        that rank of a tensor-parallel group (``gpu.backends.tensor_parallel``), sent
        the programs as ``dumps`` pickles them (default: into shared memory)."""
        threads = default_cpu_threads() if num_threads is None else num_threads
        if threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {threads}")
        torch.set_num_threads(1)  # the serving process only packs, samples nothing
        self.num_threads = threads
        """The device process's intra-op thread count (set once it has started)."""
        self.rank = rank
        self._dumps = dumps or dumps_shared
        self.stream_name = f"flare-cpu-device-{next(_stream_ids)}"
        self.start_s: float | None = None
        """Seconds ``prepare`` took to start the device process and map the programs."""
        self.held_bytes: tuple[dict[str, int], ...] = ()
        """What the device process's programs hold once prepared, per rank of its
        group (one entry without a group; every rank's on rank 0): bytes of decoder
        parameters (``weights``) and of KV pools (``kv``), ``rank_programs.held_bytes``."""
        self._lock = threading.Lock()
        self._indices: dict[int, int] = {}
        """Prepared program identity -> its index in the device process."""
        self._programs: list[PreparedProgram] = []
        self._pending: collections.deque[LaunchHandle] = collections.deque()
        self._sequence = 0
        self._closed = False
        self._lost: DeviceLost | None = None
        self._process: Any = None
        self._conn: Any = None
        self._reader: threading.Thread | None = None
        warm_up_start()

    @property
    def lost(self) -> DeviceLost | None:
        """Why the device process is gone, if it died (None while it serves)."""
        return self._lost

    @property
    def exitcode(self) -> int | None:
        """The device process's exit status once it has exited (None while it runs)."""
        if self._process is None or self._process.is_alive():
            return None
        code: int | None = self._process.exitcode
        return code

    @property
    def sentinel(self) -> int | None:
        """A handle that becomes ready when the device process exits (None before
        ``prepare``)."""
        return None if self._process is None else int(self._process.sentinel)

    @property
    def pid(self) -> int | None:
        """The device process's id (None before ``prepare``)."""
        return None if self._process is None else self._process.pid

    def prepare(
        self, programs: Sequence[PreparedProgram], *, progress: ProgressSink | None = None
    ) -> PreparationReport:
        """Start the device process and hand it ``programs`` (once per backend)."""
        if self._closed:
            raise BackendClosed("cpu backend is closed")
        if self._process is not None:
            raise BackendError("the cpu device process is already prepared")
        ordered: list[PreparedProgram] = []

        def register(program: PreparedProgram) -> None:
            self._indices[id(program)] = len(ordered)
            ordered.append(program)

        report = prepare_in_order(backend=self.name, device=self.device, programs=programs,
                                  prepare_one=register, progress=progress)
        self._programs = ordered
        self._start(ordered)
        return report

    def _start(self, programs: list[PreparedProgram]) -> None:
        started = time.perf_counter()
        context = _context()
        host_end, device_end = context.Pipe(duplex=True)
        process = context.Process(target=device_worker.main,
                                  args=(device_end, self.num_threads, self.rank),
                                  name=self.stream_name, daemon=True)
        process.start()
        device_end.close()
        self._process, self._conn = process, host_end
        try:
            host_end.send_bytes(self._dumps(programs))
            start_s = START_TIMEOUT_S + (RENDEZVOUS_TIMEOUT_S if self.rank else 0.0)
            if not host_end.poll(start_s):
                raise BackendError(f"the cpu device process did not start in "
                                   f"{start_s:.0f} s")
            reply = pickle.loads(host_end.recv_bytes())
        except (EOFError, OSError) as exc:
            self._stop_process(kill=True)
            raise DeviceLost(f"the cpu device process {exit_text(process.exitcode)} "
                             "while starting") from exc
        except BaseException:
            self._stop_process(kill=True)
            raise
        if reply[0] != "ready":
            self._stop_process(kill=True)
            raise BackendError(f"the cpu device process could not load the programs:\n{reply[1]}")
        self.num_threads = reply[1]
        self.held_bytes = tuple(reply[2])
        self.start_s = time.perf_counter() - started
        self._reader = threading.Thread(target=self._read, name=f"{self.stream_name}-reader",
                                        daemon=True)
        self._reader.start()

    def launch(self, program: PreparedProgram, inputs: Mapping[str, Any]) -> LaunchHandle:
        launched_ns = time.perf_counter_ns()
        with self._lock:
            if self._closed:
                raise BackendClosed("cpu backend is closed")
            if self._lost is not None:
                raise self._lost
            index = self._indices.get(id(program))
            if index is None or self._programs[index] is not program:
                raise ProgramNotPrepared(f"{program.shape.label()} was not prepared on cpu")
            handle = LaunchHandle(program.shape, sequence=self._sequence,
                                  launched_ns=launched_ns)
            try:
                data = pickle.dumps((index, dict(inputs), self._sequence, launched_ns),
                                    pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # fails this launch only, as a bad bind would
                raise BackendError(f"{program.shape.label()}: the inputs could not be sent "
                                   f"to the device process: {exc}") from exc
            try:
                self._conn.send_bytes(data)
            except OSError:
                pass  # the process is gone: the reader is about to say why
            else:
                self._sequence += 1
                self._pending.append(handle)
                return handle
        if self._reader is not None:
            self._reader.join(CLOSE_TIMEOUT_S)
        raise self._lost or DeviceLost("the cpu device process closed its pipe")

    def _read(self) -> None:
        """The reader thread: finish handles in launch order until the pipe closes."""
        broken: BaseException | None = None
        try:
            while self._finish_next():
                pass
        except Exception as exc:  # a garbled reply: nothing it says can be trusted
            broken = exc
            self._process.kill()
        with self._lock:
            asked_to_stop = self._closed
        if asked_to_stop and not self._pending and broken is None:
            return  # close() joins the process
        # the process is exiting: wait briefly to name its status (only this thread
        # waits for it here; close() waits only after the reader has ended)
        self._process.join(EXIT_REPORT_S)
        why = (exit_text(self._process.exitcode) if broken is None else
               f"sent a reply that could not be read ({type(broken).__name__}: {broken})")
        lost = DeviceLost(f"the cpu device process (pid {self.pid}) {why}")
        with self._lock:
            self._lost = lost
            orphans = list(self._pending)
            self._pending.clear()
        for handle in orphans:
            handle.set_fault(ProgramFault(handle.shape, "device", lost))

    def _finish_next(self) -> bool:
        """Receive one reply and finish its handle; False once the pipe has closed."""
        try:
            message = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            return False
        received_ns = time.perf_counter_ns()
        with self._lock:
            handle = self._pending.popleft()
        if handle.sequence != message[1]:
            raise BackendError(f"completion {message[1]} arrived for launch {handle.sequence}")
        if message[0] == "done":
            completion: Completion = message[2]
            timing = dataclasses.replace(
                completion.timing, wall_ns=max(received_ns - handle.launched_ns, 1))
            handle.set_completion(dataclasses.replace(completion, timing=timing))
        else:
            _, _, shape, stage, cause = message
            handle.set_fault(ProgramFault(shape, stage, cause))
        return True

    def kill(self) -> None:
        """Kill the device process now (its pending launches then fail as lost): a
        tensor-parallel peer died, and this rank would wait for it."""
        process = self._process
        if process is not None and process.is_alive():
            process.kill()

    def close(self) -> None:
        """Refuse new launches, let queued ones finish, join the device process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._conn is not None and self._lost is None:
                # already gone: the reader fails what was pending
                with contextlib.suppress(OSError):
                    self._conn.send_bytes(device_worker.STOP)
        self._stop_process(kill=False)

    def _stop_process(self, *, kill: bool) -> None:
        """Wait for the process (unless ``kill``), kill it if it is still there, then
        wait for the reader, which ends once the process's end of the pipe closes."""
        process = self._process
        if process is not None:
            if not kill:
                process.join(CLOSE_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(CLOSE_TIMEOUT_S)
        if self._reader is not None:
            self._reader.join(CLOSE_TIMEOUT_S)
        if self._conn is not None:
            self._conn.close()

    def __enter__(self) -> DeviceProcessBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
