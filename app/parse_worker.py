"""The program of a parse worker (``main``, which ``app.parse_workers`` runs in a fresh
interpreter): it checks request bodies with ``app.body_checks.check_body``.

Frames on stdin, answers on stdout (see ``app.parse_workers``); the first frame is the
pickled ``BodyLimits``, answered once loaded. Anything else the process prints goes to stderr, so nothing can
corrupt the answers. It ignores SIGINT (the serving process decides when it ends) and
runs at a lower CPU priority; it exits when its input closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import struct
import sys
from typing import BinaryIO

from app.body_checks import BodyLimits, check_body
from app.errors import ApiError

FRAME_HEADER = struct.Struct(">I")
NICENESS = 10
"""How much lower than the serving process the worker's CPU priority is: checking an
abusive body must not take a core from the streams."""


def _read_frame(source: BinaryIO) -> bytes | None:
    header = source.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    payload = source.read(size)
    return payload if len(payload) == size else None


def _write_frame(sink: BinaryIO, payload: bytes) -> None:
    sink.write(FRAME_HEADER.pack(len(payload)) + payload)
    sink.flush()


def serve(source: BinaryIO, sink: BinaryIO) -> None:
    """Answer frames until ``source`` ends."""
    first = _read_frame(source)
    if first is None:
        return
    limits: BodyLimits = pickle.loads(first)
    template = limits.template()
    _write_frame(sink, pickle.dumps(None))  # ready
    while (frame := _read_frame(source)) is not None:
        route, _, raw = frame.partition(b"\0")
        refusal = None
        try:
            check_body(route.decode(), raw, limits, template)
        except ApiError as exc:
            refusal = dataclasses.asdict(exc)
        except Exception:  # not a refusal: the serving process's own path decides
            refusal = None
        _write_frame(sink, pickle.dumps(refusal))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    sink = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr
    serve(sys.stdin.buffer, sink)
