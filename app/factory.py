"""``create_app(runtime, settings)``: the quart-trio application, its error handlers and
access checks (API key, JSON content type, CORS: ``app.access``). Error formatting
happens here and only here.
"""

from __future__ import annotations

import json

import structlog
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from actors import Runtime
from app.access import (
    add_cors_headers,
    check_api_key,
    check_json_content_type,
    preflight_response,
)
from app.errors import ApiError, internal_error
from app.routes import register_routes
from app.service import AppSettings, FlareService

log = structlog.get_logger("flare.app")

_HTTP_ERROR_TYPES = {
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
}


def _error_response(error: ApiError, service: FlareService) -> Response:
    service.metrics.http_errors.labels(str(error.status)).inc()
    return Response(json.dumps(error.to_body()), status=error.status,
                    headers=error.headers, mimetype="application/json")


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

    @app.errorhandler(ApiError)
    async def _api_error(error: ApiError) -> Response:
        if error.status >= 500:
            log.error("http.error", status=error.status, message=error.message,
                      path=request.path)
        return _error_response(error, service)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        kind, code = _HTTP_ERROR_TYPES.get(status, ("invalid_request_error", None))
        message = error.description or error.name
        if status == 413:
            message = (f"The request body exceeds the limit of "
                       f"{service.settings.max_request_bytes} bytes.")
        response = _error_response(ApiError(status, message, type=kind, code=code), service)
        if status == 413:
            # The rest of an oversized (e.g. chunked) body is never read, so this
            # connection cannot carry another request: tell the client to reconnect
            # instead of letting its next request wait behind unread body bytes.
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("http.unhandled_exception", path=request.path)
        return _error_response(internal_error(), service)

    register_routes(app, service)
    return app
