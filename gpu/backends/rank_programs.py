"""One rank's own programs, rebuilt from a payload any process can read, with the model
and its KV pool replaced by the rank's shards.

``programs_payload(programs)`` pickles the prepared programs for the ranks: every
tensor storage once, by value (request state, workspaces, draft state: each rank
writes its own), numpy views of tensor memory as views of those storages, locks
fresh, and each ``Decoder`` and ``PagedKVCache`` as a description only (its
configuration, checkpoint, device and dtype; the pool's geometry and shape). No
weight and no KV page travels: the host's decoders and pools may be placeholders
without memory (``ModelEngine.load(hold_model=False)``). Rank 0 receives the payload
from the serving process and broadcasts it to the other ranks over the group
(``gpu.backends.rank_worker``), so a rank on another machine gets the same bytes.

``rank_programs(payload, rank, world, collectives)`` rebuilds the graph in one rank's
process, substituting each described decoder by the rank's shard, read from the
checkpoint files (``gpu.model.sharding.load_shard``), and each pool by a fresh pool
of the rank's KV heads. ``held_bytes`` says what a set of programs holds.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu.backends.shared_pickling import _rebuild_view, _tensor_base
from gpu.model.config import ModelConfig
from gpu.model.decoder import Decoder
from gpu.model.kv_cache import CacheGeometry, PagedKVCache
from gpu.model.sharding import Collectives, load_shard, shard_cache
from gpu.model.weights import WeightSource

_LOCK_TYPES = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}


def _rebuild_tensor(storage: torch.UntypedStorage, offset: int, size: tuple[int, ...],
                    stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """What a rank needs to read its shard of a decoder."""

    config: ModelConfig
    source: WeightSource | None
    device: str
    dtype: torch.dtype
    max_context: int

    @classmethod
    def of(cls, decoder: Decoder) -> DecoderSpec:
        return cls(decoder.config, decoder.source, decoder.device, decoder.dtype,
                   decoder.rope_cos.shape[0])

    def placeholder(self, checkpoints: Mapping[str, Path]) -> Decoder:
        """A decoder of this description without weights, for ``load_shard``, its
        checkpoint at ``checkpoints[role]`` where given."""
        decoder = Decoder.__new__(Decoder)
        decoder.config, decoder.source = self.config, self.source
        if self.source is not None and self.source.role in checkpoints:
            decoder.source = dataclasses.replace(
                self.source, directory=checkpoints[self.source.role])
        decoder.device, decoder.dtype = self.device, self.dtype
        decoder.rope_cos = torch.empty(self.max_context, 0, device="meta")
        return decoder


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a rank needs to allocate its share of a KV pool."""

    geometry: CacheGeometry
    shape: tuple[int, ...]
    dtype: torch.dtype

    def placeholder(self) -> PagedKVCache:
        keys = torch.empty(self.shape, dtype=self.dtype, device="meta")
        return PagedKVCache.over(self.geometry, keys, keys)


class _Payload(pickle.Pickler):
    """Pickles programs for ``_Rebuild``: storages and model parts by reference."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.parts: dict[int, DecoderSpec | PoolSpec] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Decoder):
            self.parts.setdefault(id(obj), DecoderSpec.of(obj))
            return ("part", id(obj))
        if isinstance(obj, PagedKVCache):
            self.parts.setdefault(id(obj), PoolSpec(obj.geometry, tuple(obj.keys.shape),
                                                    obj.keys.dtype))
            return ("part", id(obj))
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


def _storage_bytes(storage: torch.UntypedStorage) -> bytes:
    if storage.device.type == "meta":
        raise pickle.PicklingError("a placeholder tensor outside a decoder or KV pool "
                                   "cannot travel to the ranks")
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return bytes(whole.numpy().tobytes())


def programs_payload(programs: list[Any]) -> bytes:
    """The bytes every rank rebuilds its programs from (the module doc)."""
    buffer = io.BytesIO()
    payload = _Payload(buffer)
    payload.dump(programs)
    storages = {key: _storage_bytes(s) for key, s in payload.storages.items()}
    return pickle.dumps((buffer.getvalue(), payload.parts, storages), pickle.HIGHEST_PROTOCOL)


class _Rebuild(pickle.Unpickler):
    def __init__(self, graph: bytes, substitutes: dict[int, Any],
                 storages: dict[int, bytes]) -> None:
        super().__init__(io.BytesIO(graph))
        self.substitutes = substitutes
        self.storages = storages
        self.built: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        kind, key = pid
        if kind == "part":
            return self.substitutes[key]
        storage = self.built.get(key)
        if storage is None:
            data = self.storages[key]
            whole = torch.empty(len(data), dtype=torch.uint8)
            if data:
                whole.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            storage = self.built[key] = whole.untyped_storage()
        return storage


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


def rank_programs(payload: bytes, rank: int, world: int, collectives: Collectives, *,
                  vocab_parallel: bool = False, checkpoints: Mapping[str, Path] | None = None
                  ) -> list[Any]:
    """Rank ``rank``'s private programs over its shards (the module doc).
    ``checkpoints``: where this machine keeps a checkpoint, by its role (``model``,
    ``draft``), where the serving process's path does not hold."""
    graph, parts, storages = pickle.loads(payload)
    device = next((p.device for p in parts.values() if isinstance(p, DecoderSpec)), "cpu")
    substitutes = {
        key: (load_shard(part.placeholder(checkpoints or {}), rank, world, collectives,
                         vocab_parallel=vocab_parallel) if isinstance(part, DecoderSpec)
              else shard_cache(part.placeholder(), rank, world, device=device))
        for key, part in parts.items()}
    programs: list[Any] = _Rebuild(graph, substitutes, storages).load()
    pack_projections(programs)
    return programs


def pack_projections(programs: list[Any]) -> None:
    """Pack the projections of every decoder reachable from ``programs``
    (``Decoder.pack_projections``): what a process that executes them does on
    receiving them, before its first launch."""
    for part in model_parts(programs):
        if isinstance(part, Decoder):
            part.pack_projections()


def held_bytes(programs: list[Any]) -> dict[str, int]:
    """Bytes of memory the decoders' parameters (``weights``), their projections'
    packed copies (``packed``, ``gpu.model.linear``) and the KV pools (``kv``)
    reachable from ``programs`` hold, each storage once (placeholders hold none)."""
    seen: set[int] = set()
    held = {"weights": 0, "packed": 0, "kv": 0}

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
            held["packed"] += sum(p.numel() * p.element_size() for p in part.packed.values())
        else:
            count("kv", [part.keys, part.values])
    return held
