"""Moving prepared programs into a device process without copying their buffers.

``dumps_shared(obj)`` pickles an object graph with torch.multiprocessing's reductions:
every CPU tensor's storage moves into shared memory *in place* (the sending process's
tensors keep working, now on the shared pages) and travels as a file descriptor, so
the receiving process maps the same weights, KV pool, request state and workspaces.
``loads_shared`` rebuilds the graph on the other side; it can run once per payload
(each descriptor is handed over once).

numpy views of tensor memory (``tensor.numpy()`` and slices of it, such as the
request state's ``host_views`` or a workspace's staging bytes) would otherwise be
pickled by value, as private copies the receiver's programs would silently write
into. They travel as (storage, byte offset, shape, strides, dtype) and are rebuilt
as views of the shared storage. The byte offset is taken against the storage's
address from *before* it moved: the move frees the old pages, so in the sending
process every such view dangles afterwards, and the sender must not touch the
programs' buffers once it has sent them (``gpu.backends.cpu_process`` only keeps
them as identities).

Locks (``threading.Lock``/``RLock``, for instance a forward capture's tracing lock)
guard state of one process: the receiver gets a fresh, unlocked one. Transport of
everything else is plain pickling; this module never starts a process.
"""

from __future__ import annotations

import io
import pickle
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing
from torch.multiprocessing.reductions import reduce_storage, reduce_tensor

from gpu.model import linear

_LOCK_TYPES = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}


def _tensor_base(array: np.ndarray) -> torch.Tensor | None:
    """The tensor whose memory ``array`` views, or None for an array owning its data."""
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, torch.Tensor) else None


def _rebuild_view(storage: torch.Tensor, offset: int, shape: tuple[int, ...],
                  strides: tuple[int, ...], dtype: str) -> np.ndarray:
    """A numpy view of ``storage`` (a uint8 tensor over a whole storage)."""
    return np.ndarray(shape, dtype=np.dtype(dtype), buffer=storage.numpy(), offset=offset,
                      strides=strides)


class SharedPickler(ForkingPickler):
    """torch.multiprocessing's pickler, plus numpy views of tensor memory as views."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._addresses: dict[int, int] = {}
        """Storage identity -> its data address before the pickling moved it."""

    def _remember(self, storage: torch.UntypedStorage) -> None:
        self._addresses.setdefault(storage._cdata, storage.data_ptr())

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_mkldnn:
            # a packed projection weight has no storage to share: it travels as the
            # dense weight it was packed from and is packed again on arrival
            return (linear.pack, (linear.source(obj),))
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            self._remember(obj.untyped_storage())
            return reduce_tensor(obj)  # type: ignore[no-untyped-call]
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu":
            self._remember(obj)
            return reduce_storage(obj)  # type: ignore[no-untyped-call]
        fresh_lock = _LOCK_TYPES.get(type(obj))
        if fresh_lock is not None:
            return (fresh_lock, ())
        if isinstance(obj, np.ndarray):
            base = _tensor_base(obj)
            if base is not None and base.device.type == "cpu":
                return self._reduce_view(obj, base)
        return NotImplemented

    def _reduce_view(self, array: np.ndarray, base: torch.Tensor) -> Any:
        if array.size == 0:  # views nothing: an empty array is the same thing
            return (np.empty, (array.shape, array.dtype.str))
        storage = base.untyped_storage()
        self._remember(storage)
        offset = array.__array_interface__["data"][0] - self._addresses[storage._cdata]
        if any(s < 0 for s in array.strides) or not 0 <= offset <= storage.nbytes():
            raise pickle.PicklingError("a numpy view of tensor memory with negative "
                                       "strides or outside its storage cannot be shared")
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        return (_rebuild_view, (whole, offset, array.shape, array.strides, array.dtype.str))


def dumps_shared(obj: Any) -> bytes:
    """Pickle ``obj`` moving its CPU tensors into shared memory (see the module doc)."""
    buffer = io.BytesIO()
    SharedPickler(buffer).dump(obj)
    return buffer.getvalue()


def loads_shared(data: bytes) -> Any:
    """Rebuild what ``dumps_shared`` pickled (once per payload)."""
    return pickle.loads(data)
