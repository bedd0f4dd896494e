"""The engine flags: which backend runs the programs and how (``--backend``,
``--eager-forward``, ``--no-device-process``, ``-tp/--tensor-parallel-size``,
``--host-grammars``), declared once for ``flare run`` and the bench commands.

``add_engine_flags`` declares them; ``engine_config`` turns parsed arguments into the
matching ``RuntimeConfig`` fields. A command that declares only some of them (``only``)
gets the defaults of the rest, so every command reads the same fields the same way.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Collection
from typing import Any, Literal, TypedDict

ENGINE_FLAGS = ("backend", "eager_forward", "no_device_process", "tensor_parallel_size",
                "host_grammars")
"""The parsed names (``args.<name>``) of the engine flags, in declaration order."""


class EngineConfig(TypedDict):
    """The ``RuntimeConfig`` fields the engine flags set."""

    backend: Literal["cpu", "cuda"]
    capture_forward: bool
    device_process: bool
    tensor_parallel_size: int
    resident_grammars: bool


def add_engine_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                     only: Collection[str] = ENGINE_FLAGS) -> None:
    """Declare the engine flags in ``only`` (parsed names, ``ENGINE_FLAGS``) on
    ``parser`` (a parser or an argument group)."""
    unknown = set(only) - set(ENGINE_FLAGS)
    if unknown:
        raise ValueError(f"not engine flags: {sorted(unknown)}")
    if "backend" in only:
        parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    if "eager_forward" in only:
        parser.add_argument("--eager-forward", action="store_true",
                            help="CPU: run the decoder forward op by op instead of replaying "
                                 "graphs captured at start-up (faster start, slower serving)")
    if "no_device_process" in only:
        parser.add_argument("--no-device-process", action="store_true",
                            help="CPU: run the prepared programs on a worker thread of the "
                                 "server process instead of a device process of their own")
    if "tensor_parallel_size" in only:
        parser.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size",
                            type=int, default=1, metavar="N",
                            help="CPU: run every frame on N ranks (torch.distributed, gloo), "
                                 "a device process each holding a shard of the model and KV "
                                 "pool (docs/tensor-parallel.md; MASTER_ADDR/MASTER_PORT "
                                 "choose the rendezvous)")
    if "host_grammars" in only:
        parser.add_argument("--host-grammars", action="store_true",
                            help="CPU: keep structured-output grammars on the host (every "
                                 "constrained frame waits for the previous token) instead of "
                                 "with the programs")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``RuntimeConfig`` fields of the engine flags in ``args``; a flag the command
    did not declare takes its default."""
    defaults = _defaults()

    def value(name: str) -> Any:
        return getattr(args, name, getattr(defaults, name))

    return EngineConfig(
        backend=value("backend"),
        capture_forward=not value("eager_forward"),
        device_process=not value("no_device_process"),
        tensor_parallel_size=value("tensor_parallel_size"),
        resident_grammars=not value("host_grammars"),
    )


@functools.cache
def _defaults() -> argparse.Namespace:
    """Every engine flag at its declared default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_flags(parser)
    return parser.parse_args([])
