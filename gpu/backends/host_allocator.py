"""The C allocator settings of a process that runs CPU programs.

A forward allocates the same few large temporaries on every launch (each layer's
gathered keys and values, attention outputs, logits: hundreds of KiB to a few MiB
each). glibc's defaults give such blocks back to the kernel when they are freed, the
biggest through ``munmap`` and the rest by trimming the top of the heap, so the next
launch takes page faults to map and zero the same memory again. Measured with
``flare bench forward`` on the embedded model, those faults were half of
``decode[B=32]``'s CPU time. ``keep_freed_memory`` sets the allocator to keep freed
memory for reuse: blocks up to 32 MiB come from the heap, and the heap is trimmed only
past 1 GiB of free space at its top. The process's resident size then stays at its
peak, which for a process that runs the same programs over and over is its working
set anyway.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20
"""Blocks at least this large are mapped on their own (glibc's largest setting)."""
TRIM_THRESHOLD = 1 << 30
"""Free space at the top of the heap that triggers giving it back."""


def keep_freed_memory() -> bool:
    """Set this process's allocator to keep freed memory (module docstring); False
    where the C library has no glibc ``mallopt`` (the settings are then left alone)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
