"""One rank of a tensor-parallel group, in its own process: joining the group, the
launch broadcast and the results exchange.

Every rank runs here: the ranks on the serving machine inside device processes the
serving process started (``gpu.backends.device_worker``), a rank on another machine
inside ``flare rank`` (``ops.rank_command``). Only rank 0 talks to the serving
process (its pipe); everything else travels over torch.distributed (``gloo``), so a
rank needs nothing but the rendezvous address and the checkpoint files:

- **Joining** (``join``): every rank calls ``init_process_group`` at the rendezvous;
  rank 0 broadcasts the launch block it received from the serving process (the
  group's settings and the programs' payload, ``gpu.backends.rank_programs``), every
  rank rebuilds its programs over its shards, and the ranks exchange their outcome
  (an error names the rank, and every rank fails alike) and what each holds.
- **Launches**: rank 0 broadcasts each launch it receives, then stages and queues it
  on its stream; the others stage and queue the same launch, so every rank runs the
  same frames in the same order. The forward's all-reduces run on their own group.
- **Results**: each rank's outcome of a launch (completion or fault) goes to rank 0
  (``gather_object`` on a third group, from a thread of its own, so the next frame
  need not wait for it); rank 0 combines them (``combine``) and replies to the
  serving process. A fault names the rank it happened on; if the exchange itself
  fails (a peer died), rank 0 fails that launch and every later one.
- **Stop**: rank 0 broadcasts ``STOP`` when the serving process says stop or is gone;
  every rank finishes its queued launches and leaves the group.

Every wait is bounded by the collective timeout: the launch broadcast too, since rank
0 broadcasts a ``HEARTBEAT`` when the server idles. A rank whose peer's process ended
sees its connection close at once; a rank 0 that cannot reach a peer fails the launch
and every later one (in launch order), and a rank that stops hearing from rank 0
leaves.
"""

from __future__ import annotations

import datetime
import itertools
import pickle
import queue
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu.backends.cpu import CpuStream, stage_launch
from gpu.backends.protocol import Completion, LaunchHandle
from gpu.backends.rank_programs import held_bytes, rank_programs
from gpu.backends.ranks import RENDEZVOUS_TIMEOUT_S, RankSpec
from gpu.frames import PEER_OUTPUTS_KEY
from policy.descriptors import ExecutionTiming

STOP = b""
"""Rank 0's last broadcast (the serving process's last message): finish and leave."""

HEARTBEAT = b"heartbeat"
"""What rank 0 broadcasts when no launch came for a while (``heartbeat_s``), so that
every wait for the next launch is bounded by the collective timeout."""

class RankFault(Exception):
    """A fault of one rank, as rank 0 reports it: names the rank and the cause."""


class RankStartError(RuntimeError):
    """A rank could not join the group or build its programs (every rank raises it)."""


def combine(completions: Sequence[Completion]) -> Completion:
    """One group completion from each rank's, rank zero first: rank zero's outputs
    plus the peers' under ``PEER_OUTPUTS_KEY`` (ACC-15, ACC-16), every rank's device
    interval (DUR-14: the policy takes the largest positive one), the largest wall
    interval and the largest readiness delay (DUR-15)."""
    first = completions[0]
    timings = [c.timing for c in completions]
    outputs = dict(first.outputs)
    outputs[PEER_OUTPUTS_KEY] = tuple(c.outputs for c in completions[1:])
    return Completion(shape=first.shape, outputs=outputs, timing=ExecutionTiming(
        device_intervals_ns=tuple(itertools.chain.from_iterable(
            t.device_intervals_ns for t in timings)),
        wall_ns=max(t.wall_ns for t in timings),
        readiness_delay_ns=max(t.readiness_delay_ns for t in timings)))


def combined_outcome(outcomes: Sequence[bytes]) -> bytes:
    """Rank 0's reply for one launch from every rank's pickled outcome (rank order):
    the combined completion, or the lowest rank's fault, naming a peer."""
    messages = [pickle.loads(o) for o in outcomes]
    for rank, message in enumerate(messages):
        if message[0] == "fault":
            if rank == 0:
                return outcomes[0]
            kind, sequence, shape, stage, cause = message
            fault = RankFault(f"rank {rank}: {type(cause).__name__}: {cause}")
            return pickle.dumps((kind, sequence, shape, stage, fault), pickle.HIGHEST_PROTOCOL)
    return pickle.dumps(("done", messages[0][1], combine([m[2] for m in messages])),
                        pickle.HIGHEST_PROTOCOL)


class GroupCollectives:
    """``gpu.model.sharding.Collectives`` over a torch.distributed group."""

    def __init__(self, group: Any, world: int) -> None:
        self._group = group
        self._world = world

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self._group)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self._world)]
        dist.all_gather(parts, tensor, group=self._group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True, slots=True)
class Settings:
    """What rank 0 tells every rank when the group forms."""

    timeout_s: float
    vocab_parallel: bool


@dataclass(slots=True)
class Member:
    """A rank that has joined: its programs, groups and what every rank holds."""

    spec: RankSpec
    programs: list[Any]
    control: Any
    results: Any
    held: tuple[dict[str, int], ...]
    heartbeat_s: float
    """How long rank 0 waits for a launch before it broadcasts ``HEARTBEAT``."""
    broken: RankFault | None = None
    """Set once rank 0 could not broadcast a launch: that launch and every later one
    fail, in launch order, without reaching the group."""


def join(spec: RankSpec, payload: bytes | None,
         checkpoints: Mapping[str, Path] | None = None) -> Member:
    """Join the group (waits up to ``RENDEZVOUS_TIMEOUT_S`` for every rank); rank 0
    passes the programs' ``payload``, which the others receive from it.
    ``checkpoints``: this machine's checkpoint paths by role (``rank_programs``)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://{spec.address}:{spec.port}", rank=spec.rank,
        world_size=spec.world, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    block: list[Any] = [(Settings(spec.timeout_s, spec.vocab_parallel), payload)
                        if spec.rank == 0 else None]
    dist.broadcast_object_list(block, src=0)
    settings, payload = block[0]
    collective = datetime.timedelta(seconds=settings.timeout_s)
    control = dist.new_group(timeout=collective)
    forward = dist.new_group(timeout=collective)
    results = dist.new_group(timeout=collective)
    programs: list[Any] = []
    status: tuple[str | None, dict[str, int]]
    try:
        programs = rank_programs(payload, spec.rank, spec.world,
                                 GroupCollectives(forward, spec.world),
                                 vocab_parallel=settings.vocab_parallel,
                                 checkpoints=checkpoints)
        status = (None, held_bytes(programs))
    except Exception as exc:
        status = (f"rank {spec.rank}: " + "".join(traceback.format_exception(exc)), {})
    statuses: list[Any] = [None] * spec.world
    dist.all_gather_object(statuses, status)
    errors = [error for error, _ in statuses if error]
    if errors:
        leave()
        raise RankStartError("\n".join(errors))
    return Member(spec, programs, control, results, tuple(h for _, h in statuses),
                  heartbeat_s=settings.timeout_s / 4)


def leave() -> None:
    """Leave the group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _broadcast(member: Member, data: bytes | None) -> bytes:
    box: list[Any] = [data]
    dist.broadcast_object_list(box, src=0, group=member.control)
    received: bytes = box[0]
    return received


class _Failed:
    """Stands in for a program whose launch rank 0 could not broadcast: fails in
    ``execute``, in stream order, with the reason."""

    def __init__(self, shape: Any, fault: RankFault) -> None:
        self.shape = shape
        self.fault = fault

    def bind(self, inputs: Any) -> None:
        pass

    def execute(self) -> None:
        raise self.fault

    def read_outputs(self) -> dict[str, Any]:
        return {}


def serve(member: Member, receive: Callable[[float], bytes | None] | None,
          reply: Callable[[bytes], None] | None,
          outcome: Callable[[LaunchHandle], bytes]) -> bool:
    """Run launches until ``STOP``: rank 0 ``receive``s each from the serving process
    (None after waiting the given seconds; ``STOP`` when it is gone) and ``reply``s
    each combined outcome; the others follow rank 0's broadcasts, and leave if it
    goes quiet for longer than the collective timeout. ``outcome`` pickles a
    finished handle's result. True once rank 0 stopped the group, False if it went
    away or quiet."""
    lead = member.spec.rank == 0
    outcomes: queue.Queue[bytes | None] = queue.Queue()
    exchange = threading.Thread(target=_exchange, args=(member, outcomes, reply),
                                name="flare-rank-results", daemon=True)
    exchange.start()
    stream = CpuStream("flare-device-stream")
    try:
        while True:
            if lead and receive is not None:
                data = receive(member.heartbeat_s)
                _pass_on(member, HEARTBEAT if data is None else data)
            else:
                try:
                    data = _broadcast(member, None)
                except Exception:
                    return False  # rank 0 is gone or hangs: nothing more will come
            if data is None or data == HEARTBEAT:
                continue
            if data == STOP:
                return True
            index, inputs, sequence, launched_ns = pickle.loads(data)
            program = member.programs[index]
            if member.broken is not None:
                program = _Failed(program.shape, member.broken)
            handle = LaunchHandle(program.shape, sequence=sequence, launched_ns=launched_ns)
            handle.add_done_callback(lambda h: outcomes.put(outcome(h)))
            stream.submit(stage_launch(program, inputs, handle))
    finally:
        stream.stop()
        outcomes.put(None)
        exchange.join()
        leave()


def _pass_on(member: Member, data: bytes) -> None:
    """Rank 0: broadcast ``data`` to the group, unless it is broken (then mark it)."""
    if member.broken is not None:
        return
    try:
        _broadcast(member, data)
    except Exception as exc:  # a peer is gone or hangs
        member.broken = RankFault(f"rank 0 could not pass a launch on to the group: "
                                  f"{type(exc).__name__}: {exc}")


def _exchange(member: Member, outcomes: queue.Queue[bytes | None],
              reply: Callable[[bytes], None] | None) -> None:
    """The results thread: every outcome to rank 0, which combines and replies."""
    lead, broken = member.spec.rank == 0, None
    while (own := outcomes.get()) is not None:
        gathered: list[Any] | None = [None] * member.spec.world if lead else None
        broken = broken or member.broken
        if broken is None:
            try:
                dist.gather_object(own, gathered, dst=0, group=member.results)
            except Exception as exc:  # a peer is gone or hangs: nothing more agrees
                broken = RankFault(f"the ranks' results exchange failed: "
                                   f"{type(exc).__name__}: {exc}")
        if not lead or reply is None:
            continue
        if broken is None and gathered is not None:
            reply(combined_outcome(gathered))
            continue
        message = pickle.loads(own)
        if message[0] != "fault":  # rank 0 ran it, but the group's outcome is unknown
            message = ("fault", message[1], message[2].shape, "execute", broken)
        reply(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
