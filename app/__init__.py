"""flare's HTTP face: an OpenAI-compatible quart-trio app over a ``Runtime``.

``create_app(runtime, settings)`` builds the app; ``serve_http`` serves it with
hypercorn's trio worker; ``configure_logging`` sets up structlog.
"""

from app.connections import ConnectionSettings
from app.factory import create_app
from app.log_config import configure_logging
from app.server import ServerHandle, bind_listener, serve_http
from app.service import AppSettings

__all__ = ["AppSettings", "ConnectionSettings", "ServerHandle", "bind_listener", "configure_logging", "create_app", "serve_http"]
