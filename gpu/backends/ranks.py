"""The ranks of a tensor-parallel group: who each is, where they meet, where they run.

Each rank is one process (``gpu.backends.rank_worker``): a device process of the
serving process, or ``flare rank`` on another machine. The host picks the rendezvous
(``rendezvous``): ``MASTER_ADDR`` and ``MASTER_PORT`` when set, otherwise the
loopback address and a free port. The ranks join the group with the ``gloo`` backend
(the CPU's; ``nccl`` would serve CUDA ranks). Over ``nnodes`` machines each runs
``world / nnodes`` ranks, machine ``k`` ranks ``k * world / nnodes ..``
(``node_ranks``); the serving process runs on machine 0, with rank 0.

``collective_timeout_s()`` bounds every collective (``RENDEZVOUS_TIMEOUT_S`` the
rendezvous): a rank whose
peer died or hangs fails its frame after at most that long instead of waiting
forever (``COLLECTIVE_TIMEOUT_S``, or ``FLARE_TP_TIMEOUT_S`` seconds).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

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


def node_ranks(world: int, nnodes: int, node_rank: int) -> range:
    """The ranks machine ``node_rank`` of ``nnodes`` runs (``ValueError`` if the
    ranks do not split evenly over the machines)."""
    if nnodes < 1 or world % nnodes:
        raise ValueError(f"{world} ranks do not split evenly over {nnodes} machines")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is not one of 0..{nnodes - 1}")
    per = world // nnodes
    return range(node_rank * per, (node_rank + 1) * per)
