"""The ``cpu`` backend over a tensor-parallel group: one device process per rank.

``TensorParallelBackend(size=N)`` owns N ``DeviceProcessBackend`` streams, rank
``r`` in the r-th (``gpu.backends.ranks.RankSpec``). ``prepare`` hands every rank the
same programs at once (each joins the torch.distributed group, then builds its own
shard: ``gpu.backends.rank_programs``); the host's programs stay rank zero's
identities, and the host plans as for one rank.

``launch`` sends the same launch to every rank, in the same order, and returns one
``LaunchHandle`` that finishes when every rank has:

- its outputs are rank zero's, plus ``PEER_OUTPUTS_KEY``: the other ranks' outputs in
  rank order, which the completion-validator compares with rank zero's (ACC-15,
  ACC-16);
- its timing holds every rank's device interval (``device_intervals_ns``, rank
  order; the policy takes the largest positive one, DUR-14), the largest wall
  interval and the largest readiness delay;
- the first rank fault fails it at once, without waiting for the peers. A fault in
  ``bind`` (the frame does not fit, found before any collective, alike on every rank)
  fails that launch only. Any other fault, and above all a rank whose process died
  (``DeviceLost``), takes the group down: its ranks' collectives are out of step, so
  every rank is killed, every pending launch fails, ``lost`` names the rank and the
  cause (health reports read it) and every later ``launch`` raises it.

A rank that hangs holds its peers in a collective for at most the collective timeout
(``gpu.backends.ranks.collective_timeout_s``, 30 s unless ``FLARE_TP_TIMEOUT_S``
says otherwise); the peers' frame then fails and the group stops as above.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing.connection
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpu.backends.cpu import default_cpu_threads
from gpu.backends.cpu_process import (
    DeviceLost,
    DeviceProcessBackend,
    SharedSending,
    exit_text,
)
from gpu.backends.protocol import (
    BackendClosed,
    BackendError,
    Completion,
    LaunchHandle,
    ProgramFault,
)
from gpu.backends.rank_programs import model_parts
from gpu.backends.ranks import (
    RankSpec,
    collective_timeout_s,
    rendezvous,
    vocab_parallel_default,
)
from gpu.frames import PEER_OUTPUTS_KEY
from gpu.model.decoder import Decoder
from gpu.model.sharding import check_shardable
from gpu.preparation import PreparationReport, ProgressSink
from gpu.program import PreparedProgram
from policy.descriptors import ExecutionTiming

EXIT_GRACE_S = 0.5
"""How long a failed frame waits for a peer's exit to name it as the cause."""


def combine(completions: Sequence[Completion]) -> Completion:
    """One group completion from each rank's, rank zero first (the module doc)."""
    first = completions[0]
    timings = [c.timing for c in completions]
    outputs = dict(first.outputs)
    outputs[PEER_OUTPUTS_KEY] = tuple(c.outputs for c in completions[1:])
    return Completion(shape=first.shape, outputs=outputs, timing=ExecutionTiming(
        device_intervals_ns=tuple(itertools.chain.from_iterable(
            t.device_intervals_ns for t in timings)),
        wall_ns=max(t.wall_ns for t in timings),
        readiness_delay_ns=max(t.readiness_delay_ns for t in timings)))


class _Gather:
    """Finishes one group handle from its ranks' handles."""

    def __init__(self, handle: LaunchHandle, ranks: int, on_lost: Any) -> None:
        self.handle = handle
        self._results: list[Completion | None] = [None] * ranks
        self._left = ranks
        self._lock = threading.Lock()
        self._on_lost = on_lost

    def rank_done(self, rank: int, rank_handle: LaunchHandle) -> None:
        try:
            completion = rank_handle.result()
        except ProgramFault as fault:
            cause: BaseException = fault.cause
            if isinstance(cause, DeviceLost) or fault.stage != "bind":
                # bind runs no collective; a rank failing later has left its peers'
                # collectives out of step (or timed out waiting for a hung peer)
                cause = self._on_lost(rank, cause)
            with self._lock:
                first, self._left = self._left > 0, 0
            if first:
                self.handle.set_fault(ProgramFault(fault.shape, fault.stage, cause))
            return
        with self._lock:
            if self._left == 0:
                return  # already failed by another rank
            self._results[rank] = completion
            self._left -= 1
            last = self._left == 0
        if last:
            self.handle.set_completion(combine([c for c in self._results if c is not None]))


class TensorParallelBackend:
    """The ``cpu`` backend with ``size`` ranks, each a device process."""

    name = "cpu"
    device = "cpu"

    def __init__(self, *, size: int, num_threads: int | None = None,
                 vocab_parallel: bool | None = None) -> None:
        """``num_threads``: each rank's intra-op threads (``None``: the machine's
        default share, ``default_cpu_threads() // size``, at least 1).
        ``vocab_parallel``: split the embedding and logits over the ranks (``None``:
        ``gpu.backends.ranks.vocab_parallel_default``)."""
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs >= 2 ranks, got {size}")
        threads = max(default_cpu_threads() // size, 1) if num_threads is None else num_threads
        address, port = rendezvous()
        timeout_s = collective_timeout_s()
        if vocab_parallel is None:
            vocab_parallel = vocab_parallel_default()
        self.size = size
        sharing = SharedSending()
        self.ranks = [DeviceProcessBackend(num_threads=threads, sharing=sharing, rank=RankSpec(
            rank=r, world=size, address=address, port=port, timeout_s=timeout_s,
            vocab_parallel=vocab_parallel)) for r in range(size)]
        self._lock = threading.Lock()
        self._sequence = 0
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
        """What each rank holds once prepared (``DeviceProcessBackend.held_bytes``)."""
        return tuple(r.held_bytes for r in self.ranks)

    @property
    def pids(self) -> tuple[int | None, ...]:
        """Each rank's device process id, rank order."""
        return tuple(r.pid for r in self.ranks)

    def prepare(self, programs: Sequence[PreparedProgram], *,
                progress: ProgressSink | None = None) -> PreparationReport:
        """Start every rank at once (the rendezvous waits for all) with ``programs``;
        ``ShardError`` first if a model in them does not split over the ranks."""
        for part in model_parts(programs):
            if isinstance(part, Decoder):
                check_shardable(part.config, self.size)
        reports: list[PreparationReport | None] = [None] * self.size
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
                   for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            self.close()
            raise errors[0]
        assert reports[0] is not None
        return reports[0]

    def _group_lost(self, rank: int, cause: BaseException) -> DeviceLost:
        """Rank ``rank`` failed mid-frame with ``cause`` (its process died, or a
        collective failed or timed out): the others cannot finish a collective with
        it, so the group stops. The message names a rank whose process has exited
        (a peer's broken collective is its consequence), then ``cause``."""
        if all(b.exitcode is None for b in self.ranks):
            # a peer's socket closes a moment before its process is reaped
            multiprocessing.connection.wait(
                [b.sentinel for b in self.ranks if b.sentinel is not None], EXIT_GRACE_S)
        dead = [f"rank {r}'s device process {exit_text(b.exitcode)}"
                for r, b in enumerate(self.ranks) if b.exitcode is not None]
        with self._lock:
            if self._lost is None:
                self._lost = DeviceLost("the tensor-parallel group stopped: " + "; ".join(
                    [*dead, f"rank {rank}: {type(cause).__name__}: {cause}"]))
            lost = self._lost
        for backend in self.ranks:
            backend.kill()
        return lost

    def launch(self, program: PreparedProgram, inputs: Mapping[str, Any]) -> LaunchHandle:
        launched_ns = time.perf_counter_ns()
        with self._lock:
            if self._closed:
                raise BackendClosed("cpu backend is closed")
            lost = self.lost
            if lost is not None:
                raise lost
            handle = LaunchHandle(program.shape, sequence=self._sequence,
                                  launched_ns=launched_ns)
            gather = _Gather(handle, self.size, self._group_lost)
            rank_handles = []
            for rank, backend in enumerate(self.ranks):
                try:
                    rank_handles.append(backend.launch(program, inputs))
                except BackendError as exc:
                    if rank == 0 and not isinstance(exc, DeviceLost):
                        raise  # nothing was sent (inputs that do not pickle): fails alone
                    # a rank is gone, or the launch reached only some ranks
                    self._lost = self._lost or DeviceLost(
                        f"the tensor-parallel group stopped: rank {rank}: {exc}")
                    for other in self.ranks:
                        other.kill()
                    raise self._lost from exc
            self._sequence += 1
        for rank, rank_handle in enumerate(rank_handles):
            rank_handle.add_done_callback(functools.partial(gather.rank_done, rank))
        return handle

    def close(self) -> None:
        """Refuse new launches, let every rank finish its queue, join the processes."""
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
