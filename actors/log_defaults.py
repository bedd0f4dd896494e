"""What flare's logs do when the application embedding the runtime configured none.

structlog's built-in default prints every record, debug included, to stdout: a runtime
embedded in a test suite or another program would flood it with one
``scheduler.trace`` per frame. ``quiet_unless_configured`` (called by ``open_runtime``)
therefore routes structlog through the standard library's ``logging`` when nobody has
configured structlog, as a library's logs should go: the application's logging setup
decides, and without one Python prints warnings and errors to stderr
(``logging.lastResort``). ``flare run`` configures structlog before it opens the
runtime (``app.log_config``), so this never changes the server's logs.

Tracebacks are rendered without local variables (they may hold request text).
"""

from __future__ import annotations

import structlog


def quiet_unless_configured() -> None:
    """Route structlog through stdlib ``logging`` unless it is configured already."""
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            structlog.dev.ConsoleRenderer(colors=False,
                                          exception_formatter=structlog.dev.plain_traceback),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
