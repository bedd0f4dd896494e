"""``create_app(runtime, settings)``: the quart-trio application, its error handlers and
API-key check. Errors are formatted by ``app.error_handlers`` and only there.
"""

from __future__ import annotations

import hmac

from quart import request
from quart_trio import QuartTrio

from actors import Runtime
from app.error_handlers import register_error_handlers
from app.errors import unauthorized
from app.routes import register_routes
from app.service import AppSettings, FlareService


def create_app(runtime: Runtime, settings: AppSettings | None = None) -> QuartTrio:
    """Build the app serving ``runtime``. ``app.extensions["flare"]`` is its
    ``FlareService`` (used by ``app.server`` for draining)."""
    service = FlareService(runtime, settings or AppSettings())
    app = QuartTrio("flare")
    app.config["MAX_CONTENT_LENGTH"] = service.settings.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # long generations and streams must not be cut
    app.extensions["flare"] = service

    @app.before_serving
    async def _bind_nursery() -> None:
        service.nursery = app.nursery

    @app.after_serving
    async def _stop_admitting() -> None:
        service.draining = True

    @app.before_request
    async def _check_api_key() -> None:
        key = service.settings.api_key
        if key is None or not request.path.startswith("/v1/"):
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise unauthorized("Incorrect API key provided.")

    register_error_handlers(app, service)
    register_routes(app, service)
    return app
