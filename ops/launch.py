"""Start and stop a server command on a loopback port, for the benchmarks that drive one.

``start(command, port=..., log=..., timeout_s=...)`` runs any command line (``flare run``
or a peer server), sends its output to ``log`` and returns once an HTTP health path
answers 200; a command that exits or never becomes healthy raises ``LaunchError`` naming
the command and its log. ``stop`` sends SIGTERM and waits (SIGKILL after a grace).
"""

from __future__ import annotations

import pathlib
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
HEALTH_PATHS = ("/health", "/v1/models")
"""What counts as ready: the first of these to answer 200 (OpenAI-compatible servers
without ``/health`` still list their models)."""


class LaunchError(RuntimeError):
    """A server command exited or did not become healthy in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(base_url: str, paths: Sequence[str] = HEALTH_PATHS) -> bool:
    for path in paths:
        try:
            with urllib.request.urlopen(f"{base_url}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            continue
    return False


def start(command: Sequence[str], *, port: int, log: pathlib.Path, timeout_s: float,
          paths: Sequence[str] = HEALTH_PATHS) -> subprocess.Popen[bytes]:
    """Run ``command`` (its output to ``log``) until ``http://127.0.0.1:port`` is healthy."""
    shown = " ".join(command)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        try:
            proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT,
                                    cwd=REPO_ROOT)
        except OSError as exc:
            raise LaunchError(f"cannot run {shown!r}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"{shown!r} exited with status {proc.returncode}; see {log}")
        if healthy(f"http://127.0.0.1:{port}", paths):
            return proc
        time.sleep(0.5)
    stop(proc)
    raise LaunchError(f"{shown!r} not healthy after {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
