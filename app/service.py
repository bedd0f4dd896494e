"""The serving state shared by all routes, and turning parsed requests into
``GenerationRequest`` values (tokenization, context checks, defaults).

Routes stay thin: they parse (``request_parsing``), call ``FlareService`` and format
(``openai_format``). Nothing here knows about Quart.

Work before admission is bounded: a body is at most ``max_request_bytes``; a text longer
than the context can hold (``max_context * codec.max_chars_per_token`` characters) is
refused before it is encoded; a large body is first checked in a worker process
(``app.parse_workers``: what refuses it without the model never runs in the serving
process), then parsed and tokenized in a worker thread (the codec releases the GIL while
encoding), at most ``PREPARING_PER_CLIENT`` at once per client (429 beyond) and
``PREPARING_TOTAL`` at once in all.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import trio

from actors import (
    GenerationRequest,
    ImagePrompting,
    ImageSpan,
    Runtime,
    SamplingParams,
    context_room,
    fits_context,
)
from app.body_checks import (
    BodyLimits,
    check_json_units,
    check_prompt_chars,
    tokenize_text,
)
from app.chat_template import tokenize_chat
from app.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ApiError,
    bad_request,
    context_too_long,
    shutting_down,
    too_many_preparing,
)
from app.generation import EventStream, Inflight, RequestObserver, start_generation
from app.image_parts import DEFAULT_IMAGE_LIMITS, ImageInput, ImageLimits, image_spans
from app.metrics import AppMetrics
from app.parse_workers import ParseWorkers
from app.request_parsing import (
    ChatParams,
    CommonParams,
    CompletionParams,
    TokenizeParams,
    check_model,
)

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Bodies from this size on are checked in a worker process, then parsed and tokenized off
# the event loop (about 16k tokens of text take a few milliseconds to encode; below that
# the hops cost more than the work).
OFFLOAD_BYTES = 64 * 1024
PREPARING_PER_CLIENT = 2
"""Large bodies one client (address) may have parsed or tokenized at once; more are 429."""
PREPARING_TOTAL = 4
"""Large bodies parsed or tokenized at once across all clients; more wait their turn."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class AppSettings:
    """HTTP-layer settings (the runtime's own live in ``RuntimeConfig``)."""

    api_key: str | None = None
    """When set, every ``/v1/*`` route requires ``Authorization: Bearer <api_key>``."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    served_model_name: str | None = None
    """The model id clients send; defaults to ``runtime.model_name``."""
    served_model_aliases: tuple[str, ...] = ()
    """Further ids accepted in ``model`` and listed by ``/v1/models``; responses report
    the served model name."""
    chat_template: str | None = None
    """A template used instead of the tokenizer's (``--chat-template``)."""
    default_completion_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS
    allowed_origins: tuple[str, ...] = ()
    """Origins (or ``*``) answered with CORS headers; none by default (``app.access``)."""
    metrics_require_key: bool = False
    """With ``api_key`` set, ``/metrics`` requires it too."""
    image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS
    """Bounds on chat image parts (``--limit-mm-per-prompt``, ``--allowed-media-domains``)."""
    parse_workers: int = 0
    """Processes that check large bodies (``app.parse_workers``); 0: they are checked in
    the serving process's preparing thread (``flare run`` starts one by default)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRequest:
    request: GenerationRequest
    prompt_text: str
    arrived: float
    created: int


class FlareService:
    """Everything the routes share: runtime, template, metrics, in-flight requests."""

    def __init__(self, runtime: Runtime, settings: AppSettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.model_name = settings.served_model_name or runtime.model_name
        self.model_names = tuple(dict.fromkeys((self.model_name,
                                                *settings.served_model_aliases)))
        """Every id a request may name, the reported one first."""
        self.codec = runtime.codec
        per_token = self.codec.max_chars_per_token
        self.body_limits = BodyLimits(
            max_context=runtime.max_context,
            max_text_chars=None if per_token is None else runtime.max_context * per_token,
            model_names=self.model_names, image_limits=settings.image_limits,
            template_source=(settings.chat_template if settings.chat_template is not None
                             else self.codec.chat_template),
            template_origin=("--chat-template" if settings.chat_template is not None
                             else "the model's chat template"),
            special_tokens=dict(self.codec.special_tokens))
        """What a body is checked against before it is tokenized (``app.body_checks``)."""
        self.template = self.body_limits.template()
        self.metrics = AppMetrics(runtime.statistics, model_name=self.model_name,
                                  max_model_len=runtime.max_context)
        self.inflight = Inflight()
        self.draining = False
        self.nursery: trio.Nursery | None = None
        self._preparing: Counter[str] = Counter()
        self._prepare_limiter = trio.CapacityLimiter(PREPARING_TOTAL)
        self.parse_workers = (ParseWorkers(settings.parse_workers, self.body_limits)
                              if settings.parse_workers > 0 else None)

    # -- admission ------------------------------------------------------------------

    def check_admitting(self) -> None:
        if self.draining or self.nursery is None:
            raise shutting_down()

    async def start(self, prepared: PreparedRequest, *, endpoint: str,
                    stream: bool) -> EventStream:
        self.check_admitting()
        assert self.nursery is not None
        observer = RequestObserver(self.metrics, request_id=prepared.request.request_id,
                                   endpoint=endpoint, arrived=prepared.arrived)
        try:
            return await start_generation(self.runtime, self.nursery, self.inflight,
                                          prepared.request, observer, stream=stream)
        except ApiError as exc:
            if exc.code == CONTEXT_LENGTH_EXCEEDED and endpoint == "completions":
                exc.param = "prompt"  # completions have no 'messages' to blame
            raise

    # -- request building -------------------------------------------------------------

    async def prepare(self, prepare: Callable[[], T], *, body: bytes, client: str,
                      route: str) -> T:
        """Run ``prepare`` (parse and tokenize ``body``, sent to ``route``: one of
        ``app.body_checks.ROUTE_CHECKS``): inline when small; otherwise, within the
        per-client and total bounds, after the checks that need no model (in a parse
        worker when there are any, so a body they refuse costs the serving process
        nothing but its bytes) and in a worker thread, so that a long prompt stalls
        neither the event loop nor the model."""
        if len(body) < OFFLOAD_BYTES:
            return prepare()
        with self._preparing_slot(client):
            async with self._prepare_limiter:
                passed = (self.parse_workers is not None
                          and await self.parse_workers.check(route, body))

                def checked() -> T:
                    if not passed:
                        check_json_units(body, self.body_limits.json_units)
                    return prepare()

                return await trio.to_thread.run_sync(checked)

    async def run_parse_workers(self, *, task_status: trio.TaskStatus[None]
                                = trio.TASK_STATUS_IGNORED) -> None:
        """Run the parse workers until cancelled (``app.server`` runs it around the HTTP
        server); without any, report started and return."""
        if self.parse_workers is None:
            task_status.started()
            return
        await self.parse_workers.run(task_status=task_status)

    @contextlib.contextmanager
    def _preparing_slot(self, client: str) -> Iterator[None]:
        if self._preparing[client] >= PREPARING_PER_CLIENT:
            raise too_many_preparing(PREPARING_PER_CLIENT)
        self._preparing[client] += 1
        try:
            yield
        finally:
            self._preparing[client] -= 1
            if not self._preparing[client]:
                del self._preparing[client]

    @property
    def max_text_chars(self) -> int | None:
        """Characters beyond which a text cannot fit the context (``None``: no bound)."""
        return self.body_limits.max_text_chars

    def prepare_completion(self, params: CompletionParams, *, arrived: float,
                           request_id: str | None = None) -> PreparedRequest:
        check_model(params.common.model, self.model_names)
        if isinstance(params.prompt, str):
            check_prompt_chars(params.prompt, self.body_limits)
            prompt_ids = tuple(self.codec.encode(params.prompt))
            prompt_text = params.prompt
        else:
            self.check_vocabulary(params.prompt, param="prompt")
            prompt_ids = params.prompt
            prompt_text = self.codec.decode(prompt_ids) if params.echo else ""
        max_tokens = params.common.max_tokens
        if max_tokens is None:
            max_tokens = self.settings.default_completion_max_tokens
        # echo with max_tokens 0 scores the prompt (the scored prefill) and generates nothing
        request = self._request(params.common, prompt_ids, max_tokens, prefix="cmpl",
                                prompt_logprobs=params.echo and (params.logprobs
                                                                 or max_tokens == 0),
                                logprobs=params.logprobs, request_id=request_id,
                                top_logprobs=params.top_logprobs)
        return PreparedRequest(request=request, prompt_text=prompt_text, arrived=arrived,
                               created=int(time.time()))

    def check_vocabulary(self, token_ids: tuple[int, ...], *, param: str) -> None:
        vocab = self.codec.vocab_size
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} in '{param}' is outside the vocabulary "
                              f"(size {vocab}).", param=param)

    def _check_sampling(self, sampling: SamplingParams, max_tokens: int) -> None:
        """What parsing cannot check: token ids inside the vocabulary, ``min_tokens`` at
        most the resolved ``max_tokens``."""
        self.check_vocabulary(tuple(t for t, _ in sampling.logit_bias), param="logit_bias")
        self.check_vocabulary(sampling.stop_token_ids, param="stop_token_ids")
        if sampling.min_tokens > max_tokens:
            raise bad_request(f"'min_tokens' ({sampling.min_tokens}) must not exceed "
                              f"max_tokens ({max_tokens}).", param="min_tokens")

    def tokenize(self, params: TokenizeParams) -> tuple[int, ...]:
        """The token ids of a prompt, or of a conversation rendered by the chat template."""
        check_model(params.model, self.model_names)
        if params.messages is not None and params.add_generation_prompt:
            images = [image for message in params.messages for image in message.images]
            return tokenize_chat(self.template, self.codec, params.messages,
                                 max_chars=self.max_text_chars,
                                 tools=params.tools.offered if params.tools else (),
                                 image=self._image_prompting(images)).token_ids
        return tuple(self.codec.encode(tokenize_text(self.template, params, self.body_limits)))

    def detokenize(self, model: str | None, token_ids: tuple[int, ...]) -> str:
        check_model(model, self.model_names)
        self.check_vocabulary(token_ids, param="tokens")
        return self.codec.decode(token_ids)

    def prepare_chat(self, params: ChatParams, *, arrived: float,
                     request_id: str | None = None) -> PreparedRequest:
        check_model(params.common.model, self.model_names)
        images = [image for message in params.messages for image in message.images]
        prompting = self._image_prompting(images)
        chat = tokenize_chat(self.template, self.codec, params.messages,
                             max_chars=self.max_text_chars,
                             tools=params.tools.offered if params.tools else (),
                             image=prompting)
        spans = image_spans(images, chat.image_starts, prompting)
        max_tokens = params.common.max_tokens
        if max_tokens is None:
            max_tokens = context_room(prompt_len=len(chat.token_ids),
                                      limit=self.runtime.max_context)
            if max_tokens < 1:
                raise self._too_long(len(chat.token_ids), 1)
        request = self._request(params.common, chat.token_ids, max_tokens, prefix="chatcmpl",
                                message_ends=chat.message_ends, system_end=chat.system_end,
                                logprobs=params.logprobs, request_id=request_id,
                                top_logprobs=params.top_logprobs, images=spans)
        return PreparedRequest(request=request, prompt_text="", arrived=arrived,
                               created=int(time.time()))

    def _image_prompting(self, images: Sequence[ImageInput]) -> ImagePrompting | None:
        """How this model reads images; a 400 naming the first image when it reads none."""
        if not images:
            return None
        prompting: ImagePrompting | None = getattr(self.runtime, "image_prompting", None)
        if prompting is None:
            raise bad_request(f"{images[0].field}: this model reads no images (it is not a "
                              "vision-language checkpoint); send text only.",
                              param=images[0].field)
        return prompting

    def _too_long(self, prompt_tokens: int, max_tokens: int, *,
                  param: str = "messages") -> ApiError:
        limit = self.runtime.max_context
        return context_too_long(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion).", param=param)

    def _request(self, common: CommonParams, prompt_ids: tuple[int, ...], max_tokens: int, *,
                 prefix: str, message_ends: tuple[int, ...] = (), system_end: int | None = None,
                 prompt_logprobs: bool = False, logprobs: bool = False,
                 request_id: str | None = None, top_logprobs: int = 0,
                 images: tuple[ImageSpan, ...] = ()) -> GenerationRequest:
        """``request_id``: the client's ``X-Request-Id``; the id is ``<prefix>-<it>``
        (``<prefix>-<random hex>`` without one)."""
        if not prompt_ids:
            raise bad_request("The prompt is empty (it encodes to no tokens).", param="prompt")
        if not fits_context(prompt_len=len(prompt_ids), max_tokens=max(max_tokens, 1),
                            limit=self.runtime.max_context):
            raise self._too_long(len(prompt_ids), max_tokens,
                                 param="prompt" if prefix == "cmpl" else "messages")
        self._check_sampling(common.sampling, max_tokens)
        return GenerationRequest(
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=common.sampling,
            stop=common.stop,
            ignore_eos=common.ignore_eos,
            message_ends=message_ends,
            system_end=system_end,
            prompt_logprobs=prompt_logprobs,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            client=common.user,
            request_id=f"{prefix}-{request_id or uuid.uuid4().hex}",
            grammar=common.grammar,
            images=images,
        )

    # -- shutdown -----------------------------------------------------------------------

    async def drain(self, grace_s: float) -> int:
        """Stop admitting, wait up to ``grace_s`` for in-flight requests, then end the rest
        with an error. Returns how many were ended."""
        self.draining = True
        with trio.move_on_after(grace_s):
            await self.inflight.wait_empty()
        ended = self.inflight.abort_all(
            f"The server shut down before this request finished (grace period {grace_s:g} s).")
        with trio.move_on_after(max(1.0, grace_s)):
            await self.inflight.wait_empty()
        return ended
