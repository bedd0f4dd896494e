"""structlog configuration for the whole process (``--log-format json|console``).

Every record carries ``timestamp`` (ISO 8601, UTC), ``level``, ``logger`` and ``event``;
the schema of flare's own events is in ``docs/logging.md``. Standard-library records
(hypercorn's error log) are rendered by the same renderer so a JSON log stays one JSON
object per line.

Tracebacks never carry local variables (structlog's renderers show them by default):
a frame's locals hold prompts and messages, and user content never reaches the log.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

LogFormat = Literal["json", "console"]
LOG_FORMATS: tuple[LogFormat, ...] = ("json", "console")


def configure_logging(fmt: LogFormat = "console", *, level: str = "info",
                      stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger to write to ``stream`` (stderr)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"unknown log level {level!r}")
    out = stream if stream is not None else sys.stderr
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)))
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=out.isatty(), exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_flare_handler", False):
            root.removeHandler(old)
    handler._flare_handler = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric_level)
