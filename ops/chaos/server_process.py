"""A server process's resources, read from ``/proc`` (Linux; no extra dependency).

``snapshot(pid)`` gives the resident set size (``VmRSS`` of ``/proc/PID/status``), the
number of open descriptors (``/proc/PID/fd``) and the process's TCP connections by
state: its socket inodes (``socket:[N]`` links in ``/proc/PID/fd``) matched against
``/proc/PID/net/tcp`` and ``tcp6``. Listening sockets are not connections.
Each also carries the process's CPU time (``utime + stime`` of ``/proc/PID/stat``).
``from_metrics`` reads the same figures from Prometheus text when a server exports
the standard ``process_*`` samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
    "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
    "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}


@dataclass(frozen=True, slots=True)
class Snapshot:
    rss_bytes: int | None
    fds: int | None
    connections: dict[str, int] = field(default_factory=dict)
    """The process's TCP sockets by state, listening sockets left out."""
    cpu_s: float | None = None
    """CPU time the process has used, user plus system, in seconds (its threads, not
    its children)."""

    @property
    def open_connections(self) -> int:
        return sum(self.connections.values())


def rss_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def _socket_inodes(pid: int, proc: Path) -> tuple[int, set[str]] | None:
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    inodes = set()
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue  # closed while listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return len(names), inodes


def tcp_states(table: str, inodes: set[str]) -> dict[str, int]:
    """Connections of ``inodes`` by state in one ``/proc/net/tcp``-format table."""
    counts: dict[str, int] = {}
    for line in table.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[9] not in inodes:
            continue
        state = TCP_STATES.get(cols[3], cols[3])
        if state != "LISTEN":
            counts[state] = counts.get(state, 0) + 1
    return counts


def cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float | None:
    """``utime + stime`` of ``/proc/PID/stat`` in seconds."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def snapshot(pid: int, proc: Path = Path("/proc")) -> Snapshot:
    """RSS, descriptors and TCP connections of process ``pid`` (None where unreadable)."""
    found = _socket_inodes(pid, proc)
    if found is None:
        return Snapshot(rss_bytes=rss_bytes(pid, proc), fds=None, cpu_s=cpu_seconds(pid, proc))
    fds, inodes = found
    connections: dict[str, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            table = (proc / str(pid) / "net" / name).read_text()
        except OSError:
            continue
        for state, n in tcp_states(table, inodes).items():
            connections[state] = connections.get(state, 0) + n
    return Snapshot(rss_bytes=rss_bytes(pid, proc), fds=fds, connections=connections,
                    cpu_s=cpu_seconds(pid, proc))


def from_metrics(text: str) -> Snapshot:
    """``process_resident_memory_bytes`` and ``process_open_fds`` from Prometheus text."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("process_resident_memory_bytes", "process_open_fds",
                    "process_cpu_seconds_total"):
            try:
                values[name] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    rss = values.get("process_resident_memory_bytes")
    fds = values.get("process_open_fds")
    return Snapshot(rss_bytes=None if rss is None else int(rss),
                    fds=None if fds is None else int(fds),
                    cpu_s=values.get("process_cpu_seconds_total"))
