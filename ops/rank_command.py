"""``flare rank``: this machine's ranks of a tensor-parallel group that spans machines.

The serving machine runs ``flare run -tp N --nnodes M`` (machine 0: the serving
process and ranks ``0 .. N/M - 1``); every other machine ``k`` runs ``flare rank -tp N
--nnodes M --node-rank k``, which starts ranks ``k * N/M ..`` (torchrun's spellings).
All meet at ``MASTER_ADDR:MASTER_PORT``, an address and port every machine reaches.
A rank receives its programs and every launch from rank 0 over torch.distributed
(``gpu.backends.rank_worker``) and reads its shard from the checkpoint at the path the
serving process names, or where ``--model`` (``--draft-model`` for a learned draft)
says this machine keeps it. It exits with 0 when the serving process stops the group,
1 when the group fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gpu.backends.ranks import RankSpec, node_ranks, rendezvous


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size",
                        type=int, required=True, metavar="N",
                        help="ranks in the whole group (flare run's -tp)")
    parser.add_argument("--nnodes", type=int, required=True, metavar="M",
                        help="machines the group spans (flare run's --nnodes)")
    parser.add_argument("--node-rank", type=int, required=True, metavar="K",
                        help="this machine's index, 1..M-1 (the serving machine is 0)")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="where this machine keeps the served checkpoint (default: "
                             "the serving process's --model path)")
    parser.add_argument("--draft-model", type=Path, default=None, metavar="DIR",
                        help="where this machine keeps the learned draft's checkpoint "
                             "(default: the serving process's --draft-model path)")
    parser.add_argument("--threads", type=int, default=None, metavar="T",
                        help="torch intra-op threads per rank (default: this machine's "
                             "cores minus one, shared among its ranks)")


def run_rank(spec: RankSpec, threads: int, checkpoints: dict[str, Path]) -> None:
    """One rank: join, serve rank 0's launches until it stops the group."""
    import torch

    from gpu.backends import rank_worker
    from gpu.backends.device_worker import outcome_bytes

    if threads:
        torch.set_num_threads(threads)
    member = rank_worker.join(spec, None, checkpoints)
    print(f"flare rank {spec.rank} of {spec.world}: joined, holds "
          f"{member.held[spec.rank]['weights'] / 2**20:.1f} MiB of parameters and "
          f"{member.held[spec.rank]['kv'] / 2**20:.1f} MiB of KV pool", flush=True)
    if not rank_worker.serve(member, None, None, outcome_bytes):
        raise rank_worker.RankFault("rank 0 went away or stopped answering")
    print(f"flare rank {spec.rank}: the serving process stopped the group", flush=True)


def main(args: argparse.Namespace) -> int:
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        print("flare rank: set MASTER_ADDR and MASTER_PORT to the serving machine's "
              "rendezvous (flare run's)", file=sys.stderr)
        return 2
    if args.node_rank == 0:
        print("flare rank: node rank 0 is the serving machine (flare run)", file=sys.stderr)
        return 2
    try:
        ranks = node_ranks(args.tensor_parallel_size, args.nnodes, args.node_rank)
    except ValueError as exc:
        print(f"flare rank: {exc}", file=sys.stderr)
        return 2
    from gpu.backends.cpu import default_cpu_threads

    address, port = rendezvous()
    threads = args.threads or max(default_cpu_threads() // len(ranks), 1)
    checkpoints = {role: path for role, path in (("model", args.model),
                                                 ("draft", args.draft_model)) if path}
    specs = [RankSpec(rank=r, world=args.tensor_parallel_size, address=address, port=port)
             for r in ranks]
    if len(specs) == 1:
        return _exit_status(lambda: run_rank(specs[0], threads, checkpoints))
    import torch.multiprocessing as torch_mp

    context: Any = torch_mp.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(spec, threads, checkpoints),
                                 name=f"flare-rank-{spec.rank}") for spec in specs]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return 0 if all(p.exitcode == 0 for p in processes) else 1


def _exit_status(body: Any) -> int:
    try:
        body()
    except Exception as exc:
        print(f"flare rank: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
