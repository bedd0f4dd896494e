"""Test doubles for the HTTP layer: a tiny trained tokenizer codec and a scripted
``Runtime`` that streams tokens, honours cancellation, and can refuse or fail on demand.

The fake implements the ``actors.public.Runtime`` protocol exactly; it never imports the
real runtime, so ``tests/app`` runs while the runtime is still being built.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from actors.errors import ContextTooLong, InvalidRequest, QueueFull
from actors.public import (
    Finished,
    GenerationRequest,
    PromptScores,
    RuntimeStatistics,
    StreamEvent,
    TokenDelta,
    fits_context,
)
from gpu.model.tokenizer import max_chars_per_token

SPECIAL_TOKENS = ["<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer for testing the flare HTTP layer.",
    "system user assistant tool developer messages are rendered by the chat template.",
    "Once upon a time there was a scheduler that chose programs by value per time.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation ! ? , . : ; ( ) [ ] { } < > | / \\ - _",
]
# Exercises the template's own control flow, special tokens and raise_exception.
TEST_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and loop.first %}"
    "{{ raise_exception('Conversations must not start with an assistant message') }}"
    "{% endif %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tokenizer


@dataclass
class TinyCodec:
    """``TextCodec`` over a ``tokenizers`` BPE; ``encode`` adds no special tokens."""

    tokenizer: Tokenizer
    chat_template: str | None = TEST_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))

    @property
    def max_chars_per_token(self) -> int | None:
        return max_chars_per_token(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (int(self.tokenizer.token_to_id("<eos>")),)

    @property
    def special_tokens(self) -> dict[str, str]:
        return {"bos_token": "<bos>", "eos_token": "<eos>"}


@dataclass
class FakeRuntime:
    """Streams ``reply`` one token per event. ``reply`` ending before ``max_tokens`` acts as
    end-of-sequence (finish ``stop``) unless the request ignores EOS.

    Controls: ``queue_full`` (admission raises ``QueueFull``), ``invalid`` (raises
    ``InvalidRequest``), ``fail_after`` (emit ``Finished(error)`` after n tokens),
    ``crash_after`` (raise inside the stream after n tokens), ``gated`` (each token
    waits for ``release(n)``).
    """

    codec: TinyCodec
    reply: str = "Hello world, this is a tiny reply."
    model_name: str = "flare-test"
    max_context: int = 256
    queue_full: bool = False
    invalid: bool = False
    retry_after_s: int = 7
    fail_after: int | None = None
    crash_after: int | None = None
    gated: bool = False
    device_fault: str | None = None
    """Set to report a lost device (``/health`` answers 503 with it)."""
    requests: list[GenerationRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    tokens_emitted: int = 0
    _credits: int = 0
    _credit_added: trio.Event = field(default_factory=trio.Event)
    _changed: trio.Event = field(default_factory=trio.Event)
    active: int = 0

    # -- test controls ------------------------------------------------------------

    def release(self, tokens: int) -> None:
        self._credits += tokens
        self._credit_added.set()
        self._credit_added = trio.Event()

    async def wait_until(self, predicate: object) -> None:
        """Wait until ``predicate()`` holds; re-checked after every state change."""
        assert callable(predicate)
        while not predicate():
            await self._changed.wait()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- Runtime protocol -----------------------------------------------------------

    def statistics(self) -> RuntimeStatistics:
        return RuntimeStatistics(
            requests_running=self.active, requests_waiting=0, kv_pages_used=3 * self.active,
            kv_pages_total=64, prefix_cache_hit_tokens=5,
            prompt_tokens_total=sum(len(r.prompt_token_ids) for r in self.requests),
            generation_tokens_total=self.tokens_emitted,
            executions_by_kind=(("decode", self.tokens_emitted), ("prefill", len(self.requests))),
            execution_ns_by_kind=(("decode", 1000 * self.tokens_emitted),
                                  ("prefill", 5000 * len(self.requests))),
            executions_by_graph=(("decode_b1", self.tokens_emitted),),
        )

    @asynccontextmanager
    async def generate(self, request: GenerationRequest) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        if self.queue_full:
            raise QueueFull("admission queue is full (64 waiting)", retry_after_s=self.retry_after_s)
        if self.invalid:
            raise InvalidRequest("the runtime refuses this request")
        if not fits_context(prompt_len=len(request.prompt_token_ids),
                            max_tokens=request.max_tokens, limit=self.max_context):
            raise ContextTooLong("prompt plus max_tokens exceed the context")
        self.requests.append(request)
        self.active += 1
        self._touch()
        stream = _ScriptedStream(self, request)
        try:
            yield stream
        finally:
            self.active -= 1
            if stream.done:
                self.finished.append(request.request_id)
            else:
                self.cancelled.append(request.request_id)
            self._touch()

    async def _wait_credit(self) -> None:
        while self._credits <= 0:
            await self._credit_added.wait()
        self._credits -= 1


FAKE_ALTERNATIVE_IDS = (10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
                        28, 29)
"""The fake's alternatives at every place, best first (logprobs -0.1, -0.2, ...)."""


def fake_alternatives(k: int) -> tuple[tuple[int, float], ...]:
    return tuple((t, -0.1 * (i + 1)) for i, t in enumerate(FAKE_ALTERNATIVE_IDS[:k]))


class _ScriptedStream:
    def __init__(self, runtime: FakeRuntime, request: GenerationRequest) -> None:
        self.rt = runtime
        self.request = request
        self.reply_ids = runtime.codec.encode(runtime.reply)
        self.sent = 0
        self.text = ""
        self.done = False
        self.pending: list[StreamEvent] = []
        if request.prompt_logprobs:
            ids = request.prompt_token_ids
            top = fake_alternatives(request.top_logprobs)
            self.pending.append(PromptScores(
                token_ids=ids, logprobs=(None, *(-1.0 - i / 100 for i in range(1, len(ids)))),
                top_logprobs=((), *(top for _ in ids[1:])) if top else ()))

    def __aiter__(self) -> _ScriptedStream:
        return self

    def _finish(self, reason: str, message: str = "") -> Finished:
        return Finished(reason=reason, prompt_tokens=len(self.request.prompt_token_ids),  # type: ignore[arg-type]
                        completion_tokens=self.sent, cached_prompt_tokens=2, message=message)

    async def __anext__(self) -> StreamEvent:
        if self.done:
            raise StopAsyncIteration
        event = await self._next_event()
        self.done = isinstance(event, Finished)
        return event

    async def _next_event(self) -> StreamEvent:
        await trio.lowlevel.checkpoint()
        if self.pending:
            return self.pending.pop(0)
        req, rt = self.request, self.rt
        if rt.fail_after is not None and self.sent >= rt.fail_after:
            return self._finish("error", "program fault in decode_b1")
        if rt.crash_after is not None and self.sent >= rt.crash_after:
            raise RuntimeError("fake runtime crashed")
        if self.sent >= req.max_tokens:
            return self._finish("length")
        if self.sent >= len(self.reply_ids) and not req.ignore_eos:
            return self._finish("stop")
        if rt.gated:
            await rt._wait_credit()
        token = self.reply_ids[self.sent % len(self.reply_ids)]
        piece = rt.codec.decode([token])
        self.sent += 1
        rt.tokens_emitted += 1
        rt._touch()
        new_text = self.text + piece
        for stop in req.stop:
            cut = new_text.find(stop)
            if cut >= 0:
                visible = new_text[len(self.text):cut]
                self.pending.append(self._finish("stop"))
                self.text = new_text[:cut]
                return TokenDelta(text=visible, token_ids=(token,))
        self.text = new_text
        logprobs = (-0.25,) if req.logprobs else ()
        top = fake_alternatives(req.top_logprobs)
        return TokenDelta(text=piece, token_ids=(token,), logprobs=logprobs,
                          top_logprobs=(top,) if top else ())
