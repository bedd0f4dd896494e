"""The ranks of a tensor-parallel group: rendezvous and joining torch.distributed.

Each rank is one device process (``gpu.backends.device_worker``). The host picks the
rendezvous (``rendezvous``): ``MASTER_ADDR`` and ``MASTER_PORT`` when set, otherwise
the loopback address and a free port. A rank joins the group with the ``gloo``
backend (the CPU's; ``nccl`` would serve CUDA ranks) after it has mapped the host's
programs, then runs its own shard of them (``gpu.backends.rank_programs``).

``collective_timeout_s()`` bounds every collective (``RENDEZVOUS_TIMEOUT_S`` the
rendezvous): a rank whose
peer died or hangs fails its frame after at most that long instead of waiting
forever (``COLLECTIVE_TIMEOUT_S``, or ``FLARE_TP_TIMEOUT_S`` seconds).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 30.0
"""How long a rank waits in one collective for its peers (a frame is at most a few
hundred milliseconds on the CPU)."""

RENDEZVOUS_TIMEOUT_S = 120.0
"""How long a rank waits for the others to join (each maps the programs first)."""

LOOPBACK = "127.0.0.1"

VOCAB_PARALLEL = False
"""The default layout of the embedding and logits: replicated (docs/tensor-parallel.md,
*Embedding and logits*, measured)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """Who one device process is in its group and where the group meets."""

    rank: int
    world: int
    address: str
    port: int
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    vocab_parallel: bool = False
    """Split the embedding and the vocabulary projection over the ranks
    (``gpu.model.sharding``) instead of replicating them."""


def collective_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """``FLARE_TP_TIMEOUT_S`` if set (positive seconds), else ``COLLECTIVE_TIMEOUT_S``."""
    env = os.environ if environ is None else environ
    text = env.get("FLARE_TP_TIMEOUT_S")
    if not text:
        return COLLECTIVE_TIMEOUT_S
    value = float(text)
    if not value > 0:
        raise ValueError(f"FLARE_TP_TIMEOUT_S must be positive seconds, got {text!r}")
    return value


def vocab_parallel_default(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the ranks split the embedding and logits: ``FLARE_TP_VOCAB`` is
    ``parallel`` or ``replicated`` (the default, ``VOCAB_PARALLEL``)."""
    env = os.environ if environ is None else environ
    text = env.get("FLARE_TP_VOCAB") or ("parallel" if VOCAB_PARALLEL else "replicated")
    if text not in ("parallel", "replicated"):
        raise ValueError(f"FLARE_TP_VOCAB must be parallel or replicated, got {text!r}")
    return text == "parallel"


def rendezvous(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """``(address, port)``: ``MASTER_ADDR``/``MASTER_PORT`` if set, else loopback and
    a port that was free a moment ago."""
    env = os.environ if environ is None else environ
    address = env.get("MASTER_ADDR") or LOOPBACK
    if env.get("MASTER_PORT"):
        return address, int(env["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return address, int(probe.getsockname()[1])


def join_group(programs: list[Any], spec: RankSpec) -> list[Any]:
    """Join the group (blocks until every rank has, at most ``RENDEZVOUS_TIMEOUT_S``)
    and return this rank's programs, whose collectives wait ``spec.timeout_s``."""
    from gpu.backends.rank_programs import rank_programs

    dist.init_process_group(
        "gloo", init_method=f"tcp://{spec.address}:{spec.port}", rank=spec.rank,
        world_size=spec.world, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    group = dist.new_group(timeout=datetime.timedelta(seconds=spec.timeout_s))
    return rank_programs(programs, spec.rank, spec.world, GroupCollectives(group, spec.world),
                         vocab_parallel=spec.vocab_parallel)


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


def leave_group() -> None:
    """Leave the group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
