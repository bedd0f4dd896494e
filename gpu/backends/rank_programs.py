"""One rank's own programs: a private copy of the prepared programs with the model
and its KV pool replaced by the rank's shards.

Every rank's device process maps the host's programs from shared memory
(``gpu.backends.shared_pickling``): the same pages in every process. Request state,
workspaces and draft state are written by each rank's programs, so a rank cannot run
on the shared pages; ``rank_programs`` copies the object graph once, in process
(pickling with every tensor storage cloned once, numpy views of tensor memory kept as
views of the clones), and substitutes on the way each ``Decoder`` by its shard, read
from the checkpoint files (``gpu.model.sharding.load_shard``), and each
``PagedKVCache`` by a pool of the rank's KV heads. The host's decoders and pools are
placeholders without memory (``ModelEngine.load(hold_model=False)``), so no process
holds the whole model. ``held_bytes`` says what a set of programs holds.
"""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any

import numpy as np
import torch

from gpu.backends.shared_pickling import _rebuild_view, _tensor_base
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import PagedKVCache
from gpu.model.sharding import Collectives, load_shard, shard_cache

_LOCK_TYPES = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}


def _rebuild_tensor(storage: torch.UntypedStorage, offset: int, size: tuple[int, ...],
                    stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


class _Copier(pickle.Pickler):
    """Pickles a graph for ``_Paster``: storages and substitutes travel by reference."""

    def __init__(self, file: Any, substitutes: dict[int, Any]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.substitutes = substitutes
        self.storages: dict[int, torch.UntypedStorage] = {}

    def persistent_id(self, obj: Any) -> Any:
        if id(obj) in self.substitutes:
            return ("object", id(obj))
        if isinstance(obj, torch.UntypedStorage):
            self.storages[obj._cdata] = obj
            return ("storage", obj._cdata)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return (_rebuild_tensor, (obj.untyped_storage(), obj.storage_offset(),
                                      tuple(obj.size()), obj.stride(), obj.dtype))
        fresh_lock = _LOCK_TYPES.get(type(obj))
        if fresh_lock is not None:
            return (fresh_lock, ())
        if isinstance(obj, np.ndarray) and obj.size:
            base = _tensor_base(obj)
            if base is not None:
                storage = base.untyped_storage()
                offset = obj.__array_interface__["data"][0] - storage.data_ptr()
                whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0,
                                                               (storage.nbytes(),), (1,))
                return (_rebuild_view, (whole, offset, obj.shape, obj.strides, obj.dtype.str))
        return NotImplemented


class _Paster(pickle.Unpickler):
    def __init__(self, file: Any, copier: _Copier) -> None:
        super().__init__(file)
        self.copier = copier
        self.clones: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        kind, key = pid
        if kind == "object":
            return self.copier.substitutes[key]
        clone = self.clones.get(key)
        if clone is None:
            clone = self.clones[key] = self.copier.storages[key].clone()  # type: ignore[no-untyped-call]
        return clone


def model_parts(obj: Any) -> list[Decoder | PagedKVCache]:
    """Every ``Decoder`` and ``PagedKVCache`` reachable through attributes, containers
    and slots of ``obj``."""
    seen: set[int] = set()
    found: dict[int, Any] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, torch.Tensor | np.ndarray | str | bytes
                                          | int | float | type):
            continue
        seen.add(id(item))
        if isinstance(item, Decoder | PagedKVCache):
            found[id(item)] = item
            continue
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        else:
            stack.extend(getattr(item, "__dict__", {}).values())
            for cls in type(item).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(item, name):
                        stack.append(getattr(item, name))
    return list(found.values())


def rank_programs(programs: list[Any], rank: int, world: int, collectives: Collectives, *,
                  vocab_parallel: bool = False) -> list[Any]:
    """Rank ``rank``'s private programs over its shards (the module doc)."""
    parts = model_parts(programs)
    device = next((p.device for p in parts if isinstance(p, Decoder)), "cpu")
    substitutes = {
        id(part): (load_shard(part, rank, world, collectives, vocab_parallel=vocab_parallel)
                   if isinstance(part, Decoder) else shard_cache(part, rank, world,
                                                                 device=device))
        for part in parts}
    buffer = io.BytesIO()
    copier = _Copier(buffer, substitutes)
    copier.dump(programs)
    buffer.seek(0)
    copied: list[Any] = _Paster(buffer, copier).load()
    return copied


def held_bytes(programs: list[Any]) -> dict[str, int]:
    """Bytes of memory the decoders' parameters (``weights``) and the KV pools (``kv``)
    reachable from ``programs`` hold, each storage once (placeholders hold none)."""
    seen: set[int] = set()
    held = {"weights": 0, "kv": 0}

    def count(kind: str, tensors: list[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                held[kind] += storage.nbytes()

    for part in model_parts(programs):
        if isinstance(part, Decoder):
            count("weights", [part.embed, part.lm_head, *part.qkv_weight, *part.qkv_bias, *part.gate_up_weight,
                              *part.w.values()])
        else:
            count("kv", [part.keys, part.values])
    return held
