"""The OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (JSON or
SSE), ``/v1/models``, vLLM's ``/tokenize`` and ``/detokenize``, ``/health`` and
``/metrics``.

Handlers parse, ask ``FlareService`` to admit, then either collect the events into one
JSON body or return an SSE body generator. Every error leaves as an ``ApiError`` and is
formatted by the handlers in ``app/factory.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from quart import Quart, Response, request

from actors import Finished, PromptScores, TokenDelta
from app.errors import ApiError, internal_error, model_not_found, shutting_down
from app.generation import EventStream
from app.openai_format import (
    SSE_DONE,
    CompletionLogprobs,
    ResponseHead,
    chat_body,
    chat_chunk,
    chat_logprob_entries,
    completion_body,
    completion_chunk,
    sse_event,
    usage_chunk,
)
from app.request_parsing import (
    ChatParams,
    CompletionParams,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json_object,
    parse_request_id,
    parse_tokenize,
)
from app.service import FlareService, PreparedRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
          ) -> Response:
    return Response(json.dumps(body), status=status, headers=headers,
                    mimetype="application/json")


async def _request_body() -> bytes:
    raw = await request.get_data(as_text=False)
    return raw.encode() if isinstance(raw, str) else raw


def _client() -> str:
    """Whom per-client bounds count against: the peer address."""
    return request.remote_addr or ""


def _incoming_request_id() -> str | None:
    return parse_request_id(request.headers.get("X-Request-Id"))


def _echoed_id(incoming: str | None, prepared: PreparedRequest) -> str:
    """The ``X-Request-Id`` answered: the client's own, else the generated id."""
    return incoming or prepared.request.request_id


def _head(service: FlareService, prepared: PreparedRequest) -> ResponseHead:
    return ResponseHead(request_id=prepared.request.request_id, created=prepared.created,
                        model=service.model_name)


def _failure_error(stream: EventStream) -> ApiError:
    """A non-streaming request that ended without a normal finish."""
    finished = stream.finished
    if stream.active.abort_reason or (finished is not None and finished.reason == "cancelled"):
        return shutting_down()
    if finished is not None and finished.reason == "error":
        return internal_error(finished.message or "generation failed")
    return internal_error(stream.early_end_message())


def _error_event(message: str) -> bytes:
    return sse_event({"error": {"message": message, "type": "server_error", "param": None,
                                "code": "generation_failed"}})


def _sse(body: AsyncIterator[bytes], request_id: str) -> Response:
    response = Response(body, mimetype="text/event-stream",
                        headers={**SSE_HEADERS, "X-Request-Id": request_id})
    response.timeout = None  # streams have no response timeout (stack notes)
    return response


def register_routes(app: Quart, service: FlareService) -> None:
    @app.get("/health")
    async def health() -> Response:
        if service.draining:
            return _json({"status": "draining"}, 503)
        fault = service.runtime.device_fault
        if fault is not None:  # the device process died: every request now fails
            return _json({"status": "unhealthy", "error": fault}, 503)
        return _json({"status": "ok", "model": service.model_name,
                      "requests_in_flight": len(service.inflight)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), mimetype=None,
                        headers={"Content-Type": CONTENT_TYPE_LATEST})

    def model_card() -> dict[str, Any]:
        return {"id": service.model_name, "object": "model", "created": 0,
                "owned_by": "flare", "max_model_len": service.runtime.max_context}

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id != service.model_name:
            raise model_not_found(model_id)
        return _json(model_card())

    @app.post("/tokenize")
    async def tokenize() -> Response:
        raw = await _request_body()
        tokens = await service.prepare(
            lambda: service.tokenize(parse_tokenize(parse_json_object(raw))),
            body=raw, client=_client())
        return _json({"count": len(tokens), "max_model_len": service.runtime.max_context,
                      "tokens": list(tokens)})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        raw = await _request_body()
        text = await service.prepare(
            lambda: service.detokenize(*parse_detokenize(parse_json_object(raw))),
            body=raw, client=_client())
        return _json({"prompt": text})

    @app.post("/v1/completions")
    async def completions() -> Response:
        arrived = time.monotonic()
        service.check_admitting()
        incoming = _incoming_request_id()
        raw = await _request_body()

        def prepare() -> tuple[CompletionParams, PreparedRequest]:
            params = parse_completion(parse_json_object(raw))
            return params, service.prepare_completion(params, arrived=arrived,
                                                      request_id=incoming)

        params, prepared = await service.prepare(prepare, body=raw, client=_client())
        stream = await service.start(prepared, endpoint="completions",
                                     stream=params.common.stream)
        logprobs = CompletionLogprobs(service.codec) if params.logprobs else None
        if params.common.stream:
            return _sse(_completion_events(service, prepared, stream, echo=params.echo,
                                           logprobs=logprobs,
                                           include_usage=params.common.include_usage),
                        _echoed_id(incoming, prepared))
        text: list[str] = [prepared.prompt_text] if params.echo else []
        try:
            async for event in stream:
                if isinstance(event, PromptScores) and logprobs is not None:
                    logprobs.add(event.token_ids, event.logprobs)
                elif isinstance(event, TokenDelta):
                    text.append(event.text)
                    if logprobs is not None:
                        logprobs.add(event.token_ids, event.logprobs)
        finally:
            stream.close()
        finished = stream.finished
        if finished is None or finished.reason not in ("stop", "length"):
            raise _failure_error(stream)
        return _json(completion_body(
            _head(service, prepared), text="".join(text),
            logprobs=None if logprobs is None else logprobs.body(), finished=finished),
            headers={"X-Request-Id": _echoed_id(incoming, prepared)})

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        arrived = time.monotonic()
        service.check_admitting()
        incoming = _incoming_request_id()
        raw = await _request_body()

        def prepare_chat() -> tuple[ChatParams, PreparedRequest]:
            params = parse_chat(parse_json_object(raw))
            return params, service.prepare_chat(params, arrived=arrived, request_id=incoming)

        params, prepared = await service.prepare(prepare_chat, body=raw, client=_client())
        stream = await service.start(prepared, endpoint="chat", stream=params.common.stream)
        if params.common.stream:
            return _sse(_chat_events(service, prepared, stream, logprobs=params.logprobs,
                                     include_usage=params.common.include_usage),
                        _echoed_id(incoming, prepared))
        text: list[str] = []
        entries: list[dict[str, Any]] | None = [] if params.logprobs else None
        try:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    text.append(event.text)
                    if entries is not None:
                        entries.extend(chat_logprob_entries(service.codec, event.token_ids,
                                                            event.logprobs))
        finally:
            stream.close()
        finished = stream.finished
        if finished is None or finished.reason not in ("stop", "length"):
            raise _failure_error(stream)
        return _json(chat_body(
            _head(service, prepared), text="".join(text), logprobs=entries,
            finished=finished), headers={"X-Request-Id": _echoed_id(incoming, prepared)})


def _finish_events(finished: Finished | None, stream: EventStream, last_chunk: dict[str, Any],
                   usage: dict[str, Any] | None) -> list[bytes]:
    """The closing events of a stream: finish chunk and usage, or an error event."""
    if finished is None:
        return [_error_event(stream.early_end_message()), SSE_DONE]
    if finished.reason not in ("stop", "length"):
        message = finished.message or f"generation ended: {finished.reason}"
        if stream.active.abort_reason:
            message = stream.active.abort_reason
        return [_error_event(message), SSE_DONE]
    events = [sse_event(last_chunk)]
    if usage is not None:
        events.append(sse_event(usage))
    events.append(SSE_DONE)
    return events


async def _completion_events(service: FlareService, prepared: PreparedRequest,
                             stream: EventStream, *, echo: bool,
                             logprobs: CompletionLogprobs | None,
                             include_usage: bool) -> AsyncIterator[bytes]:
    head = _head(service, prepared)
    try:
        if echo and logprobs is None:
            yield sse_event(completion_chunk(head, text=prepared.prompt_text))
        async for event in stream:
            if isinstance(event, PromptScores):
                if echo and logprobs is not None:
                    yield sse_event(completion_chunk(
                        head, text=prepared.prompt_text,
                        logprobs=logprobs.add(event.token_ids, event.logprobs)))
            elif isinstance(event, TokenDelta) and (
                    event.text or (logprobs is not None and event.token_ids)):
                chunk_logprobs = (None if logprobs is None
                                  else logprobs.add(event.token_ids, event.logprobs))
                yield sse_event(completion_chunk(head, text=event.text,
                                                 logprobs=chunk_logprobs))
        finished = stream.finished
        last = completion_chunk(head, text="",
                                finish_reason=finished.reason if finished else None)
        usage = (usage_chunk(head, object_name="text_completion", finished=finished)
                 if include_usage and finished is not None else None)
        for chunk in _finish_events(finished, stream, last, usage):
            yield chunk
    finally:
        stream.close()


async def _chat_events(service: FlareService, prepared: PreparedRequest, stream: EventStream,
                       *, logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    head = _head(service, prepared)
    try:
        yield sse_event(chat_chunk(head, delta={"role": "assistant", "content": ""}))
        async for event in stream:
            if isinstance(event, TokenDelta) and (event.text or (logprobs and event.token_ids)):
                entries = (chat_logprob_entries(service.codec, event.token_ids, event.logprobs)
                           if logprobs else None)
                yield sse_event(chat_chunk(head, delta={"content": event.text},
                                           logprobs=entries))
        finished = stream.finished
        last = chat_chunk(head, delta={}, finish_reason=finished.reason if finished else None)
        usage = (usage_chunk(head, object_name="chat.completion.chunk", finished=finished)
                 if include_usage and finished is not None else None)
        for chunk in _finish_events(finished, stream, last, usage):
            yield chunk
    finally:
        stream.close()
