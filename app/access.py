"""Who may call the server, and how: API-key check, JSON content type, CORS.

- **API key.** With ``AppSettings.api_key`` set, every ``/v1/*`` route, ``/tokenize`` and
  ``/detokenize`` (and ``/metrics`` with ``metrics_require_key``) need ``Authorization:
  Bearer <key>``. The key is compared as UTF-8 bytes in constant time (``hmac.compare_digest``): header values arrive decoded
  as latin-1, so the client's raw bytes are recovered before comparing, and a non-ASCII
  key matches a client that sends it in UTF-8.
- **Content type.** A POST must declare ``Content-Type: application/json`` (a ``charset``
  parameter, if any, must be UTF-8); anything else is a 415. A web page can post
  ``text/plain`` cross-origin without a preflight, but not ``application/json``, so this
  keeps any page a browser opens from driving a server without a key.
- **CORS.** By default the server sends no CORS headers (browsers then refuse cross-origin
  calls). ``AppSettings.allowed_origins`` names the origins (or ``*``) that may call it:
  their preflight ``OPTIONS`` is answered with 204 and their responses carry
  ``Access-Control-Allow-Origin``.
"""

from __future__ import annotations

import hmac

from quart import Request, Response

from app.errors import unauthorized, unsupported_media_type
from app.service import AppSettings

JSON_MIMETYPE = "application/json"
UTF8_CHARSETS = frozenset({"utf-8", "utf8"})
CORS_ALLOWED_METHODS = "GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type"
CORS_EXPOSED_HEADERS = "X-Request-Id, Retry-After"
CORS_MAX_AGE_S = 600
KEYED_PATHS = ("/tokenize", "/detokenize")
"""Routes outside ``/v1/`` that require the API key like ``/v1/*``."""


def _header_bytes(value: str) -> bytes:
    """The bytes the client sent for a header value (servers decode them as latin-1)."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


def check_api_key(settings: AppSettings, request: Request) -> None:
    """Raise a 401 ``ApiError`` unless ``request`` may pass (see the module text)."""
    key = settings.api_key
    if key is None or request.method == "OPTIONS":
        return
    guarded = request.path.startswith("/v1/") or request.path in KEYED_PATHS or (
        settings.metrics_require_key and request.path == "/metrics")
    if not guarded:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    if not hmac.compare_digest(_header_bytes(token.strip()), key.encode("utf-8")):
        raise unauthorized("Incorrect API key provided.")


def check_json_content_type(request: Request) -> None:
    """Raise a 415 ``ApiError`` for a POST whose body is not declared as UTF-8 JSON."""
    if request.method != "POST":
        return
    charset = request.mimetype_params.get("charset")
    if request.mimetype != JSON_MIMETYPE or (
            charset is not None and charset.lower() not in UTF8_CHARSETS):
        raise unsupported_media_type(request.headers.get("Content-Type", ""))


def _allowed_origin(settings: AppSettings, request: Request) -> str | None:
    origin = request.headers.get("Origin")
    if origin is None or not settings.allowed_origins:
        return None
    if "*" in settings.allowed_origins:
        return "*"
    return origin if origin in settings.allowed_origins else None


def preflight_response(settings: AppSettings, request: Request) -> Response | None:
    """The answer to a CORS preflight from an allowed origin; None for anything else."""
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
        return None
    origin = _allowed_origin(settings, request)
    if origin is None:
        return None
    response = Response("", status=204)
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Allow-Methods"] = CORS_ALLOWED_METHODS
    response.headers["Access-Control-Allow-Headers"] = request.headers.get(
        "Access-Control-Request-Headers", CORS_DEFAULT_HEADERS)
    response.headers["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)
    response.headers["Vary"] = "Origin"
    return response


def add_cors_headers(settings: AppSettings, request: Request, response: Response) -> None:
    """Let an allowed origin read ``response`` (no headers for any other caller)."""
    origin = _allowed_origin(settings, request)
    if origin is None or "Access-Control-Allow-Origin" in response.headers:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED_HEADERS
    response.headers["Vary"] = "Origin"
