"""How much memory the serving process and its device processes hold.

``memory_of(pid)`` reads Linux's ``/proc/PID/smaps_rollup``: the resident set (RSS:
every page the process maps that is in memory, shared pages included) and the
proportional set (PSS: each shared page divided among the processes that map it, so
the PSS of a set of processes adds up to what they hold together). ``flare bench
runtime`` prints both for the serving process and every device process
(docs/tensor-parallel.md, *Memory*).
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

DEVICE_PROCESS_PREFIX = "flare-cpu-device-"
"""Name prefix of the CPU backend's device processes (``DeviceProcessBackend``)."""


def memory_of(pid: int) -> dict[str, int] | None:
    """``{"rss": bytes, "pss": bytes}`` of process ``pid`` (None: not readable here)."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    fields = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss") and rest.strip().endswith("kB"):
            fields[key.lower()] = int(rest.split()[0]) * 1024
    return fields if len(fields) == 2 else None


def device_process_ids() -> list[int]:
    """The live CPU device processes of this process, in the order they started."""
    children = [c for c in multiprocessing.active_children()
                if c.name.startswith(DEVICE_PROCESS_PREFIX) and c.pid is not None]
    return [c.pid for c in sorted(children, key=lambda c: int(c.name.rsplit("-", 1)[1]))
            if c.pid is not None]


def serving_memory() -> dict[str, dict[str, int]]:
    """Memory of this (the serving) process and of each device process, by name:
    ``server``, then ``device 0``, ``device 1``, ... (under ``-tp`` the ranks in order)."""
    found = {}
    for name, pid in [("server", os.getpid()),
                      *((f"device {i}", p) for i, p in enumerate(device_process_ids()))]:
        memory = memory_of(pid)
        if memory is not None:
            found[name] = memory
    return found
