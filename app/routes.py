"""The OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (JSON or
SSE), ``/v1/models``, vLLM's ``/tokenize`` and ``/detokenize``, ``/health`` and
``/metrics``.

Handlers parse, ask ``FlareService`` to admit, then either collect the events into one
JSON body or return an SSE body generator. Every error leaves as an ``ApiError`` and is
formatted by the handlers in ``app/factory.py``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, TypeVar

import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Quart, Response, request

from actors import Finished, PromptScores, StreamEvent, TokenDelta
from app.body_checks import CHAT, COMPLETIONS, DETOKENIZE, TOKENIZE
from app.choices import NORMAL_ENDS, Choice, Choices, start_choices
from app.errors import model_not_found
from app.field_table import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    IGNORED_FIELDS_HEADER,
    TOKENIZE_FIELDS,
    checked_parse,
)
from app.logprobs_format import CompletionLogprobs, chat_logprob_entries
from app.openai_format import (
    SSE_DONE,
    ResponseHead,
    chat_body,
    chat_choice,
    chat_chunk,
    completion_body,
    completion_choice,
    completion_chunk,
    finish_reason,
    sse_event,
    usage_body,
    usage_chunk,
)
from app.request_parsing import (
    ChatParams,
    CommonParams,
    CompletionParams,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json_object,
    parse_request_id,
    parse_tokenize,
)
from app.service import FlareService, PreparedRequest
from app.tool_calls import apply_to_body, tool_call_events

log = structlog.get_logger("flare.app.requests")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


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


def _response_headers(incoming: str | None, prepared: PreparedRequest,
                      ignored: tuple[str, ...]) -> dict[str, str]:
    """``X-Request-Id`` (the client's own, else the generated id) and the accepted but
    ignored fields (``app.field_table``), which are also logged as a warning."""
    headers = {"X-Request-Id": incoming or prepared.request.request_id}
    if ignored:
        headers[IGNORED_FIELDS_HEADER] = ",".join(ignored)
        log.warning("request.ignored_fields", request_id=prepared.request.request_id,
                    fields=list(ignored))
    return headers


def _parsed(raw: bytes, table: dict[str, Any], parse: Callable[[dict[str, Any]], T]
            ) -> tuple[T, tuple[str, ...]]:
    return checked_parse(parse_json_object(raw), table, parse)


def _head(service: FlareService, choices: Choices) -> ResponseHead:
    first = choices.choices[0].prepared
    return ResponseHead(request_id=first.request.request_id, created=first.created,
                        model=service.model_name)


def _error_event(message: str) -> bytes:
    return sse_event({"error": {"message": message, "type": "server_error", "param": None,
                                "code": "generation_failed"}})


def _sse(body: AsyncIterator[bytes], headers: dict[str, str]) -> Response:
    response = Response(body, mimetype="text/event-stream", headers={**SSE_HEADERS, **headers})
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

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0,
                "owned_by": "flare", "max_model_len": service.runtime.max_context}

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [model_card(n) for n in service.model_names]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id not in service.model_names:
            raise model_not_found(model_id)
        return _json(model_card(model_id))

    @app.post("/tokenize")
    async def tokenize() -> Response:
        raw = await _request_body()
        tokens = await service.prepare(
            lambda: service.tokenize(_parsed(raw, TOKENIZE_FIELDS, parse_tokenize)[0]),
            body=raw, client=_client(), route=TOKENIZE)
        return _json({"count": len(tokens), "max_model_len": service.runtime.max_context,
                      "tokens": list(tokens)})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        raw = await _request_body()
        text = await service.prepare(
            lambda: service.detokenize(*_parsed(raw, DETOKENIZE_FIELDS, parse_detokenize)[0]),
            body=raw, client=_client(), route=DETOKENIZE)
        return _json({"prompt": text})

    @app.post("/v1/completions")
    async def completions() -> Response:
        arrived = time.monotonic()
        service.check_admitting()
        incoming = _incoming_request_id()
        raw = await _request_body()

        def prepare() -> tuple[CompletionParams, list[PreparedRequest], tuple[str, ...]]:
            params, ignored = _parsed(raw, COMPLETION_FIELDS, parse_completion)
            request_id = incoming or uuid.uuid4().hex  # one id for every prompt's choices
            return params, [service.prepare_completion(
                dataclasses.replace(params, prompt=prompt), arrived=arrived,
                request_id=request_id) for prompt in params.prompts], ignored

        params, prepared, ignored = await service.prepare(prepare, body=raw, client=_client(),
                                                          route=COMPLETIONS)
        headers = _response_headers(incoming, prepared[0], ignored)
        choices = await start_choices(service, prepared, params.common.n,
                                      endpoint="completions", stream=params.common.stream)
        if params.common.stream:
            return _sse(_completion_events(service, choices, params), headers)
        return _json(await _completion_result(service, choices, params), headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        arrived = time.monotonic()
        service.check_admitting()
        incoming = _incoming_request_id()
        raw = await _request_body()

        def prepare_chat() -> tuple[ChatParams, PreparedRequest, tuple[str, ...]]:
            params, ignored = _parsed(
                raw, CHAT_FIELDS, partial(parse_chat, image_limits=service.settings.image_limits))
            return (params, service.prepare_chat(params, arrived=arrived, request_id=incoming),
                    ignored)

        params, prepared, ignored = await service.prepare(prepare_chat, body=raw,
                                                          client=_client(), route=CHAT)
        headers = _response_headers(incoming, prepared, ignored)
        choices = await start_choices(service, [prepared], params.common.n, endpoint="chat",
                                      stream=params.common.stream)
        if params.common.stream:
            return _sse(tool_call_events(_chat_events(service, choices, params), params.tools),
                        headers)
        return _json(apply_to_body(await _chat_result(service, choices, params), params.tools),
                     headers=headers)


def _completion_logprobs(service: FlareService, choices: Choices, params: CompletionParams
                         ) -> dict[int, CompletionLogprobs | None]:
    return {c.index: (CompletionLogprobs(service.codec, top=params.top_logprobs)
                      if params.logprobs else None) for c in choices.choices}


async def _collect(choices: Choices, take: Callable[[Choice, StreamEvent], None]) -> None:
    """Read every choice's events into ``take``; raise the failure if one fails (which
    ends the others)."""
    async with choices:
        async for choice, event in choices:
            if isinstance(event, Finished) and event.reason not in NORMAL_ENDS:
                break
            take(choice, event)
    if not choices.all_ended_normally():
        raise choices.failure_error()


async def _completion_result(service: FlareService, choices: Choices,
                             params: CompletionParams) -> dict[str, Any]:
    logprobs = _completion_logprobs(service, choices, params)
    texts: dict[int, list[str]] = {
        c.index: [c.prepared.prompt_text] if params.echo else [] for c in choices.choices}

    def take(choice: Choice, event: StreamEvent) -> None:
        choice_logprobs = logprobs[choice.index]
        if isinstance(event, PromptScores) and choice_logprobs is not None:
            choice_logprobs.add(event.token_ids, event.logprobs, event.top_logprobs)
        elif isinstance(event, TokenDelta):
            texts[choice.index].append(event.text)
            if choice_logprobs is not None:
                choice_logprobs.add(event.token_ids, event.logprobs, event.top_logprobs)

    await _collect(choices, take)
    return completion_body(_head(service, choices), usage=choices.usage(), choices=[
        completion_choice(c.index, text="".join(texts[c.index]),
                          logprobs=None if (lp := logprobs[c.index]) is None else lp.body(),
                          finish_reason=finish_reason(c.finished))
        for c in choices.choices if c.finished is not None])


async def _chat_result(service: FlareService, choices: Choices,
                       params: ChatParams) -> dict[str, Any]:
    texts: dict[int, list[str]] = {c.index: [] for c in choices.choices}
    entries: dict[int, list[dict[str, Any]]] = {c.index: [] for c in choices.choices}

    def take(choice: Choice, event: StreamEvent) -> None:
        if isinstance(event, TokenDelta):
            texts[choice.index].append(event.text)
            if params.logprobs:
                entries[choice.index].extend(chat_logprob_entries(
                    service.codec, event.token_ids, event.logprobs, event.top_logprobs))

    await _collect(choices, take)
    return chat_body(_head(service, choices), usage=choices.usage(), choices=[
        chat_choice(c.index, text="".join(texts[c.index]),
                    logprobs=entries[c.index] if params.logprobs else None,
                    finish_reason=finish_reason(c.finished))
        for c in choices.choices if c.finished is not None])


def _closing_events(choices: Choices, head: ResponseHead, *, object_name: str,
                    include_usage: bool) -> list[bytes]:
    """The end of a stream: the usage chunk and ``[DONE]``, or an error event."""
    if not choices.all_ended_normally():
        return [_error_event(choices.early_end_message()), SSE_DONE]
    if include_usage:
        return [sse_event(usage_chunk(head, object_name=object_name, usage=choices.usage())),
                SSE_DONE]
    return [SSE_DONE]


async def _sse_choices(choices: Choices, head: ResponseHead, common: CommonParams, *,
                       object_name: str, opening: list[tuple[Choice, dict[str, Any]]],
                       chunk_for: Callable[[Choice, StreamEvent], dict[str, Any] | None],
                       finish_chunk: Callable[[Choice, str], dict[str, Any]]
                       ) -> AsyncIterator[bytes]:
    """The SSE body of a generation: ``opening`` chunks, one chunk per event that has
    one (``chunk_for``), each choice's finish chunk, then the closing events. With
    ``continuous_usage_stats`` every chunk carries its choice's usage so far."""

    def event(choice: Choice, chunk: dict[str, Any]) -> bytes:
        if common.continuous_usage:
            chunk["usage"] = usage_body(choice.usage_so_far())
        return sse_event(chunk)

    async with choices:
        for choice, first in opening:
            yield event(choice, first)
        async for choice, stream_event in choices:
            chunk: dict[str, Any] | None
            if isinstance(stream_event, Finished):
                if stream_event.reason not in NORMAL_ENDS:
                    break
                chunk = finish_chunk(choice, finish_reason(stream_event))
            else:
                chunk = chunk_for(choice, stream_event)
            if chunk is not None:
                yield event(choice, chunk)
        for closing in _closing_events(choices, head, object_name=object_name,
                                       include_usage=common.include_usage):
            yield closing


def _completion_events(service: FlareService, choices: Choices,
                       params: CompletionParams) -> AsyncIterator[bytes]:
    head = _head(service, choices)
    logprobs = _completion_logprobs(service, choices, params)
    opening = [(c, completion_chunk(head, index=c.index, text=c.prepared.prompt_text))
               for c in choices.choices] if params.echo and not params.logprobs else []

    def chunk_for(choice: Choice, event: StreamEvent) -> dict[str, Any] | None:
        choice_logprobs = logprobs[choice.index]
        if isinstance(event, PromptScores):
            if not (params.echo and choice_logprobs is not None):
                return None
            return completion_chunk(
                head, index=choice.index, text=choice.prepared.prompt_text,
                logprobs=choice_logprobs.add(event.token_ids, event.logprobs,
                                             event.top_logprobs))
        if isinstance(event, TokenDelta) and (
                event.text or (choice_logprobs is not None and event.token_ids)):
            return completion_chunk(
                head, index=choice.index, text=event.text,
                logprobs=(None if choice_logprobs is None
                          else choice_logprobs.add(event.token_ids, event.logprobs,
                                                   event.top_logprobs)))
        return None

    return _sse_choices(
        choices, head, params.common, object_name="text_completion", opening=opening,
        chunk_for=chunk_for,
        finish_chunk=lambda choice, reason: completion_chunk(
            head, index=choice.index, text="", finish_reason=reason))


def _chat_events(service: FlareService, choices: Choices,
                 params: ChatParams) -> AsyncIterator[bytes]:
    head = _head(service, choices)
    opening = [(c, chat_chunk(head, index=c.index, delta={"role": "assistant", "content": ""}))
               for c in choices.choices]

    def chunk_for(choice: Choice, event: StreamEvent) -> dict[str, Any] | None:
        if not isinstance(event, TokenDelta) or not (
                event.text or (params.logprobs and event.token_ids)):
            return None
        entries = (chat_logprob_entries(service.codec, event.token_ids, event.logprobs,
                                        event.top_logprobs)
                   if params.logprobs else None)
        return chat_chunk(head, index=choice.index, delta={"content": event.text},
                          logprobs=entries)

    return _sse_choices(
        choices, head, params.common, object_name="chat.completion.chunk", opening=opening,
        chunk_for=chunk_for,
        finish_chunk=lambda choice, reason: chat_chunk(
            head, index=choice.index, delta={}, finish_reason=reason))
