"""The ``cpu`` backend over a tensor-parallel group: one process per rank.

``TensorParallelBackend(size=N)`` starts this machine's ranks as device processes
(``DeviceProcessBackend``, rank ``r`` in the r-th; all N unless ``nnodes`` says the
group spans machines, ``gpu.backends.ranks.node_ranks``: the others are ``flare
rank`` processes there). ``prepare`` starts them at once; they meet the other ranks
at the rendezvous, and rank 0 passes the programs' payload on to every rank
(``gpu.backends.rank_worker``), each of which builds its own shard
(``gpu.backends.rank_programs``). The host's programs stay rank zero's identities,
and the host plans as for one rank.

Only rank 0 talks to the host: ``launch`` sends each launch to rank 0, which
broadcasts it to the group, and its ``LaunchHandle`` finishes with rank 0's reply,
which combines every rank's outcome (``rank_worker.combine``):

- its outputs are rank zero's, plus ``PEER_OUTPUTS_KEY``: the other ranks' outputs in
  rank order, which the completion-validator compares with rank zero's (ACC-15,
  ACC-16);
- its timing holds every rank's device interval (``device_intervals_ns``, rank
  order; the policy takes the largest positive one, DUR-14), the largest readiness
  delay and the host's wall interval;
- a fault names the rank it happened on. A fault in ``bind`` (the frame does not fit,
  found before any collective, alike on every rank) fails that launch only. Any
  other fault, and above all a rank whose process died (``DeviceLost``), takes the
  group down: its ranks' collectives are out of step, so every local rank is killed,
  every pending launch fails, ``lost`` names the cause (health reports read it) and
  every later ``launch`` raises it.

A rank that hangs holds its peers in a collective for at most the collective timeout
(``gpu.backends.ranks.collective_timeout_s``, 30 s unless ``FLARE_TP_TIMEOUT_S``
says otherwise); the peers' frame then fails and the group stops as above.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpu.backends.cpu import default_cpu_threads
from gpu.backends.cpu_process import DeviceLost, DeviceProcessBackend, exit_text
from gpu.backends.protocol import (
    BackendClosed,
    BackendError,
    LaunchHandle,
    ProgramFault,
)
from gpu.backends.rank_programs import model_parts, programs_payload
from gpu.backends.ranks import (
    RankSpec,
    collective_timeout_s,
    node_ranks,
    rendezvous,
    vocab_parallel_default,
)
from gpu.model.decoder import Decoder
from gpu.model.sharding import check_shardable
from gpu.preparation import PreparationReport, ProgressSink
from gpu.program import PreparedProgram

EXIT_GRACE_S = 0.5
"""How long a failed frame waits for a peer's exit to name it as the cause."""


def stops_group(fault: ProgramFault) -> bool:
    """Whether a launch's fault stops the group: any but a fault in ``bind`` (which
    runs no collective and fails alike on every rank), and always a lost process."""
    return isinstance(fault.cause, DeviceLost) or fault.stage != "bind"


def _no_programs(programs: list[PreparedProgram]) -> bytes:
    """What a rank other than 0 is sent: nothing (rank 0 passes the programs on)."""
    return b"peer"


class TensorParallelBackend:
    """The ``cpu`` backend with ``size`` ranks, each a process."""

    name = "cpu"
    device = "cpu"

    def __init__(self, *, size: int, num_threads: int | None = None,
                 vocab_parallel: bool | None = None, nnodes: int = 1) -> None:
        """``num_threads``: each rank's intra-op threads (``None``: the machine's
        default share, ``default_cpu_threads() // ranks here``, at least 1).
        ``vocab_parallel``: split the embedding and logits over the ranks (``None``:
        ``gpu.backends.ranks.vocab_parallel_default``). ``nnodes``: machines the group
        spans; this is machine 0 (the others run ``flare rank``), and ``MASTER_ADDR``
        and ``MASTER_PORT`` must name an address they reach."""
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs >= 2 ranks, got {size}")
        local = node_ranks(size, nnodes, 0)
        if nnodes > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
            raise ValueError("a tensor-parallel group across machines meets at "
                             "MASTER_ADDR:MASTER_PORT, an address every machine reaches: "
                             "set both")
        threads = (max(default_cpu_threads() // len(local), 1) if num_threads is None
                   else num_threads)
        address, port = rendezvous()
        timeout_s = collective_timeout_s()
        if vocab_parallel is None:
            vocab_parallel = vocab_parallel_default()
        self.size = size
        self.ranks = [DeviceProcessBackend(
            num_threads=threads, dumps=programs_payload if r == 0 else _no_programs,
            rank=RankSpec(rank=r, world=size, address=address, port=port,
                          timeout_s=timeout_s, vocab_parallel=vocab_parallel))
            for r in local]
        """This machine's ranks; ``ranks[0]`` is rank 0, the one the host talks to."""
        self._lock = threading.Lock()
        self._closed = False
        self._lost: DeviceLost | None = None

    @property
    def num_threads(self) -> int:
        return self.ranks[0].num_threads

    @property
    def start_s(self) -> float | None:
        starts = [r.start_s for r in self.ranks]
        return None if None in starts else max(s for s in starts if s is not None)

    @property
    def lost(self) -> DeviceLost | None:
        """Why the group can no longer run (a rank's process died), else None."""
        if self._lost is not None:
            return self._lost
        for rank, backend in enumerate(self.ranks):
            if backend.lost is not None:
                return DeviceLost(f"rank {rank}: {backend.lost}")
        return None

    @property
    def held_bytes(self) -> tuple[dict[str, int], ...]:
        """What each rank of the group holds once prepared, rank order
        (``DeviceProcessBackend.held_bytes``; rank 0 collects every rank's)."""
        return self.ranks[0].held_bytes

    @property
    def pids(self) -> tuple[int | None, ...]:
        """Each local rank's device process id, rank order."""
        return tuple(r.pid for r in self.ranks)

    def prepare(self, programs: Sequence[PreparedProgram], *,
                progress: ProgressSink | None = None) -> PreparationReport:
        """Start every local rank at once (the rendezvous waits for all) with
        ``programs``; ``ShardError`` first if a model in them does not split."""
        for part in model_parts(programs):
            if isinstance(part, Decoder):
                check_shardable(part.config, self.size)
        reports: list[PreparationReport | None] = [None] * len(self.ranks)
        errors: list[BaseException] = []

        def start(rank: int) -> None:
            try:
                reports[rank] = self.ranks[rank].prepare(
                    programs, progress=progress if rank == 0 else None)
            except BaseException as exc:
                errors.append(exc)
                for other in self.ranks:  # the others would wait for this rank
                    other.kill()

        threads = [threading.Thread(target=start, args=(r,), name=f"flare-rank-{r}-start")
                   for r in range(len(self.ranks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            self.close()
            raise errors[0]
        assert reports[0] is not None
        return reports[0]

    def _group_lost(self, cause: BaseException) -> DeviceLost:
        """A frame failed with ``cause`` past ``bind`` (a process died, a collective
        failed or timed out): the ranks cannot finish a collective together again, so
        the group stops. The message names a local rank whose process has exited (a
        peer's broken collective is its consequence), then ``cause``."""
        if all(b.exitcode is None for b in self.ranks):
            # a peer's socket closes a moment before its process is reaped
            multiprocessing.connection.wait(
                [b.sentinel for b in self.ranks if b.sentinel is not None], EXIT_GRACE_S)
        dead = [f"rank {r}'s device process {exit_text(b.exitcode)}"
                for r, b in enumerate(self.ranks) if b.exitcode is not None]
        with self._lock:
            if self._lost is None:
                self._lost = DeviceLost("the tensor-parallel group stopped: " + "; ".join(
                    [*dead, f"{type(cause).__name__}: {cause}"]))
            lost = self._lost
        for backend in self.ranks:
            backend.kill()
        return lost

    def _finish(self, handle: LaunchHandle, lead: LaunchHandle) -> None:
        """Finish the group's ``handle`` from rank 0's ``lead`` (the module doc)."""
        try:
            completion = lead.result()
        except ProgramFault as fault:
            cause: BaseException = fault.cause
            if stops_group(fault):
                cause = self._group_lost(cause)
            handle.set_fault(ProgramFault(fault.shape, fault.stage, cause))
            return
        handle.set_completion(completion)

    def launch(self, program: PreparedProgram, inputs: Mapping[str, Any]) -> LaunchHandle:
        launched_ns = time.perf_counter_ns()
        with self._lock:
            if self._closed:
                raise BackendClosed("cpu backend is closed")
            lost = self.lost
            if lost is not None:
                raise lost
        try:
            lead = self.ranks[0].launch(program, inputs)
        except DeviceLost as exc:
            raise self._group_lost(exc) from exc
        except BackendError:
            raise  # nothing was sent (inputs that do not pickle): fails alone
        handle = LaunchHandle(program.shape, sequence=lead.sequence, launched_ns=launched_ns)
        lead.add_done_callback(lambda done: self._finish(handle, done))
        return handle

    def close(self) -> None:
        """Refuse new launches; rank 0 tells the group to stop once every rank has
        finished its queue; join the local processes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.lost is not None:
            for backend in self.ranks:
                backend.kill()
        for backend in self.ranks:
            backend.close()

    def __enter__(self) -> TensorParallelBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
