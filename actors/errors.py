"""The runtime's error family. ``app/`` maps each class to an HTTP status in one place.

- ``InvalidRequest``: the request can never be served as sent (400).
- ``ContextTooLong``: prompt plus ``max_tokens`` exceed the model's context (400).
- ``QueueFull``: the bounded admission queue is full; try again later (429).
- ``RuntimeShutDown``: the runtime is stopping and admits nothing new (503).
- ``GenerationFailed``: a program fault or malformed completion failed this request
  after admission; it arrives as a ``Finished(reason="error")`` event, never raised
  into other requests.
"""

from __future__ import annotations


class FlareRuntimeError(Exception):
    """Base of every error the runtime raises to its callers."""


class AdmissionError(FlareRuntimeError):
    """Raised by ``Runtime.generate`` when a request is refused before admission."""


class InvalidRequest(AdmissionError):
    """Raised when a request can never be served as sent (bad parameter values)."""


class ContextTooLong(AdmissionError):
    """Raised when prompt tokens plus ``max_tokens`` exceed the model's context."""


class QueueFull(AdmissionError):
    """Raised when the bounded admission queue is full.

    ``retry_after_s`` is the caller's hint for a ``Retry-After`` header.
    """

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RuntimeShutDown(AdmissionError):
    """Raised when the runtime is shutting down and admits no new request."""


class GenerationFailed(FlareRuntimeError):
    """A request failed after admission (program fault, malformed completion)."""
