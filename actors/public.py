"""The runtime's public surface: what ``app/``, benchmarks and integration tests use.

``open_runtime(config)`` (in ``actors/system.py``) yields an object satisfying
``Runtime``. A caller submits a ``GenerationRequest`` and reads ``StreamEvent`` values::

    async with open_runtime(config) as rt:
        async with rt.generate(request) as events:
            async for event in events:
                ...

Leaving the ``generate`` block early (client gone, cancellation) cancels the request
within one frame; its resources stay owned through its last submitted fence.
Messages are frozen, slotted, keyword-only values (house style).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol

# Per-request sampling: one value from the request to the device row.
from gpu import MAX_LOGIT_BIAS_ENTRIES as MAX_LOGIT_BIAS_ENTRIES

# The most alternatives a request may ask for per token.
from gpu import TOP_LOGPROBS as TOP_LOGPROBS

# The alternatives at one place: (token id, logprob) pairs, best first.
from gpu import Alternatives as Alternatives
from gpu import ImageSpan as ImageSpan
from gpu import SamplingParams as SamplingParams

# The context rule admission applies, for callers that check a request before submitting.
from policy import context_room as context_room
from policy import fits_context as fits_context

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
"""What a ``GrammarSpec.source`` is (see ``GrammarSpec``)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A structured-output constraint on a request's generated tokens.

    ``source`` by ``kind``: ``json_object`` any JSON object (``source`` is ignored, "" by
    convention); ``json_schema`` a JSON Schema as JSON text; ``regex`` a regular
    expression the whole output must match; ``choice`` a JSON list of strings, one of
    which the output must equal; ``grammar`` a Lark grammar (llguidance's dialect, which
    also reads GBNF) whose ``start`` rule the output must match. ``actors.grammar_problem``
    says whether a spec compiles; the runtime refuses one that does not
    (``InvalidRequest``).
    """

    kind: GrammarKind
    source: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One generation, already tokenized by the caller.

    ``message_ends``: token offsets where completed chat messages end, in order
    (checkpoint anchors, QUEUE-16..19 / OPEN-23); empty for plain completions.
    ``system_end``: token offset where the system prompt ends, if any (OPEN-36).
    ``prompt_logprobs``: also return the prompt tokens' logprobs (scored prefill);
    with it, ``max_tokens`` may be 0: the prompt is scored and nothing is generated.
    ``logprobs``: report each generated token's logprob; ``top_logprobs`` (0 to
    ``TOP_LOGPROBS``): also its (and each scored prompt token's) most likely
    alternatives. Every logprob is the model's raw log-softmax (temperature 1, before
    top-k/top-p filtering).
    ``client``: a tag for fairness accounting and logs.
    ``prefill_group``: requests submitted with the same non-empty group and the same
    prompt share one prefill (the ``n`` choices of one API request): while the first
    one admitted prefills the prompt, the others wait in admission, then start from
    its prompt pages through the prefix cache (each is still its own request to the
    scheduler, with its own row, sampling and stream).
    ``grammar``: constrain the output to a grammar (structured output): every sampled
    token is one the grammar allows, end-of-sequence only where it may end, and the
    request finishes (``stop``) when the grammar is complete.
    ``images``: the prompt's images; each span's positions hold the model's image
    placeholder id, and its features replace their embeddings.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    message_ends: tuple[int, ...] = ()
    system_end: int | None = None
    prompt_logprobs: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    client: str = ""
    request_id: str = ""
    prefill_group: str = ""
    grammar: GrammarSpec | None = None
    images: tuple[ImageSpan, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ImagePrompting:
    """How a vision-language checkpoint reads images in a prompt: each image stands as
    ``tokens_per_image`` copies of ``image_token_id``."""

    image_token_id: int
    tokens_per_image: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptScores:
    """Logprobs of the prompt tokens (the first is ``None``: nothing predicts it) and,
    when the request asked for ``top_logprobs``, each token's alternatives (the first
    empty); ``top_logprobs`` is empty otherwise."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[Alternatives, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenDelta:
    """Newly visible output: ``text`` is valid UTF-8 and never contains a stop string
    or a prefix that could still become one."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[Alternatives, ...] = ()
    """Per token of ``token_ids``, its first ``top_logprobs`` alternatives (empty when
    the request asked for none)."""


FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """The last event of every stream."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    message: str = ""
    queued_s: float | None = None
    """Submission to the first frame that served it (its queue time); ``None`` if no
    frame ever did. Runtime clock, like the two below (``docs/logging.md``, metrics)."""
    prefill_s: float | None = None
    """First frame to the first output token; ``None`` without output."""
    decode_s: float | None = None
    """First to last output token; ``None`` without output."""


StreamEvent = PromptScores | TokenDelta | Finished


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeStatistics:
    """A frozen snapshot for ``/metrics`` and logs (seed: Funded acceptance learning,
    last paragraph: executions by kind)."""

    requests_running: int
    requests_waiting: int
    admission_reordered: int = 0
    """Requests admission queued ahead of an earlier arrival (``--admission-order
    least-slack``)."""
    kv_pages_used: int
    """Pages in use by requests (a cached page a request shares counts here)."""
    kv_pages_total: int
    kv_pages_cached: int = 0
    """Pages held by the prefix cache alone (evictable, free for the asking)."""
    prefix_cache_hit_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    executions_by_kind: tuple[tuple[str, int], ...]
    execution_ns_by_kind: tuple[tuple[str, int], ...]
    executions_by_graph: tuple[tuple[str, int], ...]
    speculative_source: str = ""
    """The proposal source of a speculative load (``draft`` or ``copy``); empty when off."""
    speculative_frames: int = 0
    """Complete speculative programs run."""
    speculative_drafted_tokens: int = 0
    """Drafts the target verified."""
    speculative_accepted_tokens: int = 0
    speculative_accepted_by_position: tuple[int, ...] = ()
    """``[k]``: verified rounds whose draft at 0-based position ``k`` was accepted."""
    counterfactual_rounds: int = 0
    """Counterfactual rounds decided: copy rounds replayed by the host
    (``actors.copy_counterfactuals``) or the learned draft's depth-one proposals of
    width-one steps (adaptive speculation, ``docs/speculative-selection.md``)."""
    counterfactual_drafted_tokens: int = 0
    """Drafts those rounds offered."""
    counterfactual_accepted_tokens: int = 0
    """Drafts of those rounds that equalled the tokens the target then produced."""
    prefix_cache_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache (every admitted prompt but scored
    ones); ``prefix_cache_hit_tokens`` of them were found."""
    window_snapshots: int = 0
    """Window snapshots (each restored at once) of requests whose images span several
    windows (``actors.window_snapshots``)."""
    preemptions: int = 0
    """Resident requests sent back to the queue. Always 0: a request becomes resident
    only with pages for its worst case, so nothing is ever preempted (OPEN-3)."""


class TextCodec(Protocol):
    """The served model's tokenizer, as the HTTP layer needs it (arch: ``app`` applies
    the chat template and tokenizes)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Long texts are encoded in a worker thread: an
        implementation must not hold the GIL for the whole encoding."""
        ...

    @property
    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can cover (a text longer than
        ``limit * max_chars_per_token`` cannot fit ``limit`` tokens), or ``None`` when the
        tokenizer gives no such bound."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def chat_template(self) -> str | None:
        """The model's jinja chat template (``tokenizer_config.json``), if any."""
        ...

    @property
    def special_tokens(self) -> dict[str, str]:
        """Template variables such as ``bos_token`` and ``eos_token``."""
        ...


class Runtime(Protocol):
    """What ``open_runtime`` yields."""

    @property
    def codec(self) -> TextCodec: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_context(self) -> int:
        """The context limit admission applies (``policy.lifecycle.context_limit``):
        a request fits when ``fits_context`` holds for it."""
        ...

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        """Admit ``request`` (raising an ``AdmissionError`` if refused) and yield its
        events; the last one is always ``Finished``."""
        ...

    def statistics(self) -> RuntimeStatistics: ...

    @property
    def device_fault(self) -> str | None:
        """Why the device can no longer run programs (the CPU device process died:
        every request then fails), or None while it serves; ``/health`` reports it."""
        ...
