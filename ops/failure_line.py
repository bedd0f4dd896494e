"""The one line a command that cannot start writes (``flare run: error: ...``, or one
JSON object in the schema of flare's JSON log under ``--log-format json``).

Written directly, not through the logging configuration: a usage error comes before
logging is configured, and a failed start must not configure the process's logging.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import TextIO

EXIT_STATUS = 2
"""The exit status of every usage error and start-up failure (argparse's)."""


def failure_line(message: str, *, prog: str, json_format: bool, event: str,
                 logger: str) -> str:
    """``message`` on one line: ``PROG: error: MESSAGE`` or a JSON object."""
    text = " ".join(message.split())
    if not json_format:
        return f"{prog}: error: {text}"
    now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"error": text, "exit_status": EXIT_STATUS, "event": event,
                       "level": "error", "logger": logger, "timestamp": now})


def write_failure(message: str, *, prog: str, json_format: bool, event: str, logger: str,
                  stream: TextIO | None = None) -> int:
    """Write ``failure_line`` to ``stream`` (stderr); returns ``EXIT_STATUS``."""
    out = stream or sys.stderr
    out.write(failure_line(message, prog=prog, json_format=json_format, event=event,
                           logger=logger) + "\n")
    out.flush()
    return EXIT_STATUS


def found_in(exc: BaseException, kinds: tuple[type[BaseException], ...]
             ) -> BaseException | None:
    """``exc`` if it is one of ``kinds``, else the first such exception inside the
    exception groups trio's nurseries raise; None when there is none."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = found_in(inner, kinds)
            if found is not None:
                return found
    return None
