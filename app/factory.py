"""``create_app(runtime, settings)``: the quart-trio application, its error handlers and
access checks (API key, JSON content type, CORS: ``app.access``). Errors are formatted
by ``app.error_handlers`` and only there.
"""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from actors import Runtime
from app.access import (
    add_cors_headers,
    check_api_key,
    check_json_content_type,
    preflight_response,
)
from app.error_handlers import register_error_handlers
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
    async def _check_access() -> Response | None:
        preflight = preflight_response(service.settings, request)
        if preflight is not None:
            return preflight
        check_api_key(service.settings, request)
        check_json_content_type(request)
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        add_cors_headers(service.settings, request, response)
        return response

    register_error_handlers(app, service)
    register_routes(app, service)
    return app
