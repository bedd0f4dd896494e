"""The device process: the body of one CPU stream, in a process of its own.

``gpu.backends.cpu_process`` starts ``main`` in a fresh process (never a fork of the
serving process) for each stream. The process receives the prepared programs once,
their buffers in shared memory (``gpu.backends.shared_pickling``), then serves
launches until the host says stop or its end of the pipe closes:

- the main thread receives each launch ``(index, inputs, sequence, launched_ns)``,
  stages it (``stage_launch``: validation and packing, the host work a GPU stream's
  caller does) and queues it on a ``CpuStream``, so the next frame is packed while
  the current one executes, as in the in-process backend;
- the stream's worker thread runs ``bind -> execute -> read_outputs`` in FIFO order
  and measures the execution interval here (``run_launch``), and the completion, or
  the fault's stage and cause, goes back on the pipe in launch order.

Everything a program mutates in Python (bound packs, host bounds, captured graphs)
lives only here. Messages are pickled values, so the transport knows nothing of what
inputs or outputs a program takes: a program that gains an input or an output needs
nothing from this module. Torch's intra-op threads are set here (``num_threads``), and
the allocator keeps freed memory for the next launch (``gpu.backends.host_allocator``).

A rank of a tensor-parallel group (``rank``) runs the same stream, fed through the
group instead (``gpu.backends.rank_worker``): rank 0 receives the programs' payload
and the launches here and passes them on, and replies once per launch for every rank;
the other ranks use the pipe only to say they are ready.

Signals: the process ignores SIGINT and SIGTERM, which a terminal or a supervisor
sends to the whole process group; the serving process decides when it stops (it
drains first), and if that process dies outright the pipe closes and this one exits.
"""

from __future__ import annotations

import pickle
import signal
import threading
import traceback
from typing import Any

import torch

from gpu.backends import rank_worker
from gpu.backends.cpu import CpuStream, stage_launch
from gpu.backends.host_allocator import keep_freed_memory
from gpu.backends.protocol import LaunchHandle
from gpu.backends.rank_programs import held_bytes, pack_projections
from gpu.backends.ranks import RankSpec
from gpu.backends.shared_pickling import loads_shared

STOP = rank_worker.STOP
"""The host's last message: finish the queued launches and exit."""


class RemoteFault(Exception):
    """Stands in for a program's exception that could not be pickled back to the host;
    the message keeps its type, text and the device process's traceback."""


def _fault_cause(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RemoteFault`` describing it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        text = "".join(traceback.format_exception(exc)).rstrip()
        return RemoteFault(f"{type(exc).__name__}: {exc}\n{text}")


def outcome_bytes(handle: LaunchHandle) -> bytes:
    """A finished launch's reply, pickled: ``("done", sequence, completion)`` or
    ``("fault", sequence, shape, stage, cause)`` (outputs that do not pickle become a
    ``read_outputs`` fault, so the host still gets an answer for this launch)."""
    try:
        completion = handle.result()
    except Exception as fault:
        cause = getattr(fault, "cause", fault)
        stage = getattr(fault, "stage", "execute")
        message: tuple[Any, ...] = ("fault", handle.sequence, handle.shape, stage,
                                    _fault_cause(cause))
        return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    try:
        return pickle.dumps(("done", handle.sequence, completion), pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        cause = RemoteFault(f"the outputs could not be sent back: {type(exc).__name__}: {exc}")
        return pickle.dumps(("fault", handle.sequence, handle.shape, "read_outputs", cause),
                            pickle.HIGHEST_PROTOCOL)


class _Replies:
    """The send side of the pipe, shared by the receiving and the completing thread."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        self.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, data: bytes) -> None:
        with self._lock:
            self._conn.send_bytes(data)

    def completed(self, handle: LaunchHandle) -> None:
        """Done-callback of every launch: its outcome, in stream order."""
        self.send_bytes(outcome_bytes(handle))


def main(conn: Any, num_threads: int, rank: RankSpec | None = None) -> None:
    """Receive the programs, then serve launches until ``STOP`` or end of pipe.
    ``rank``: this process is one rank of a tensor-parallel group
    (``gpu.backends.rank_worker``): rank 0 receives the programs' payload and the
    launches here and passes them on to the group; the other ranks receive both from
    rank 0 and use the pipe only to say they are ready."""
    for ignored in (signal.SIGINT, signal.SIGTERM):
        signal.signal(ignored, signal.SIG_IGN)
    if num_threads:
        torch.set_num_threads(num_threads)
    keep_freed_memory()
    replies = _Replies(conn)
    try:
        data = conn.recv_bytes()
        if rank is None:
            programs = loads_shared(data)
            pack_projections(programs)
            held: tuple[dict[str, int], ...] = (held_bytes(programs),)
        else:
            member = rank_worker.join(rank, data if rank.rank == 0 else None)
            held = member.held
    except Exception as exc:
        replies.send(("failed", "".join(traceback.format_exception(exc))))
        return
    replies.send(("ready", torch.get_num_threads(), held))
    if rank is not None:
        try:
            rank_worker.serve(member, lambda wait_s: _receive(conn, wait_s),
                              replies.send_bytes, outcome_bytes)
        finally:
            conn.close()
        return
    stream = CpuStream("flare-device-stream")
    try:
        while True:
            data = _receive(conn)
            if data is None or data == STOP:
                return
            index, inputs, sequence, launched_ns = pickle.loads(data)
            program = programs[index]
            handle = LaunchHandle(program.shape, sequence=sequence, launched_ns=launched_ns)
            handle.add_done_callback(replies.completed)
            stream.submit(stage_launch(program, inputs, handle))
    finally:
        stream.stop()
        conn.close()


def _receive(conn: Any, wait_s: float | None = None) -> bytes | None:
    """The host's next message; ``STOP`` once the host is gone (nobody waits for the
    queued launches then); None if none came in ``wait_s`` seconds."""
    try:
        if wait_s is not None and not conn.poll(wait_s):
            return None
        data: bytes = conn.recv_bytes()
    except (EOFError, OSError):
        return STOP
    return data
