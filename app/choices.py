"""The choices of one API request: ``n`` siblings per prompt, started together and read
as one interleaved event stream.

Every choice is its own runtime request (its own row, sampling, stream and finish
reason; the scheduler sees each). The ``n`` siblings of one prompt carry one
``prefill_group``, so the runtime prefills their prompt once and the others start from
its pages (``actors.GenerationRequest.prefill_group``). Choice ``k`` of prompt ``p`` has
index ``p * n + k`` (OpenAI's and vLLM's numbering).

**Seeds.** With a request ``seed`` s, sibling ``i`` samples with seed ``s + i`` (wrapped
into 0..2**63-1), so sibling 0 is exactly the ``n = 1`` request and every sibling is
reproducible; without one, each sibling draws its own at admission.

**Usage** counts each prompt once (its first choice's cached tokens) and sums the
completion tokens of every choice.

One forwarder task per choice (in the app's nursery, started when the events are first
read) moves its events into one channel; ``close`` ends every sibling's generation, so a
client that leaves cancels them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import trio

from actors import Finished, GenerationRequest, StreamEvent, TokenDelta
from app.errors import ApiError, internal_error, shutting_down
from app.generation import EventStream
from app.openai_format import Usage
from app.service import FlareService, PreparedRequest

SEED_SPACE = 2**63
MERGED_BUFFER = 16
"""Events queued between the forwarders and the writer: as for one stream
(``app.generation.EVENT_BUFFER``), a slow client applies back-pressure."""
NORMAL_ENDS = ("stop", "length")


def sibling_seed(seed: int | None, sibling: int) -> int | None:
    """Sibling ``sibling``'s seed: ``seed + sibling`` within the seed space."""
    if seed is None or sibling == 0:
        return seed
    derived = seed + sibling
    return derived - SEED_SPACE if derived >= SEED_SPACE else derived


def sibling_requests(request: GenerationRequest, n: int, *, first_index: int,
                     rename: bool) -> tuple[GenerationRequest, ...]:
    """The ``n`` runtime requests of one prompt. With ``rename`` (the API request has
    several choices) each gets the id ``<id>-<choice index>``; with ``n > 1`` they
    share one prefill group."""
    group = f"{request.request_id}-p{first_index // n}" if n > 1 else ""
    return tuple(dataclasses.replace(
        request,
        sampling=dataclasses.replace(request.sampling,
                                     seed=sibling_seed(request.sampling.seed, i)),
        request_id=f"{request.request_id}-{first_index + i}" if rename else request.request_id,
        prefill_group=group,
    ) for i in range(n))


@dataclass(slots=True, eq=False)
class Choice:
    index: int
    prompt_index: int
    prepared: PreparedRequest
    """Its prompt's prepared request (the response head, ``prompt_text`` for echo)."""
    stream: EventStream
    completion_tokens: int = 0
    """Tokens generated so far."""

    @property
    def finished(self) -> Finished | None:
        return self.stream.finished

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.request.prompt_token_ids)

    def usage_so_far(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens,
                     completion_tokens=self.completion_tokens)


async def start_choices(service: FlareService, prepared: Sequence[PreparedRequest], n: int,
                        *, endpoint: str, stream: bool) -> Choices:
    """Admit every choice (``n`` per prepared prompt); on a refusal, end the ones
    already admitted and raise it."""
    rename = len(prepared) * n > 1
    siblings = [sibling_requests(one.request, n, first_index=p * n, rename=rename)
                for p, one in enumerate(prepared)]
    # Every prompt's first choice before any other sibling: the prompts prefill side by
    # side instead of each waiting behind the previous prompt's siblings in admission.
    order = sorted(range(len(prepared) * n), key=lambda index: (index % n != 0, index))
    started: dict[int, Choice] = {}
    try:
        for index in order:
            one = prepared[index // n]
            events = await service.start(
                dataclasses.replace(one, request=siblings[index // n][index % n]),
                endpoint=endpoint, stream=stream)
            started[index] = Choice(index=index, prompt_index=index // n, prepared=one,
                                    stream=events)
    except BaseException:
        for choice in started.values():
            choice.stream.close()
        raise
    assert service.nursery is not None
    return Choices([started[index] for index in range(len(order))], service.nursery)


class Choices:
    """Every choice's events, interleaved: iterate ``(choice, event)`` inside
    ``async with``."""

    def __init__(self, choices: list[Choice], nursery: trio.Nursery) -> None:
        self.choices = choices
        self._nursery = nursery
        self._send, self._receive = trio.open_memory_channel[tuple[Choice, StreamEvent]](
            MERGED_BUFFER)
        self._forwarding = False

    async def __aenter__(self) -> Choices:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """End every choice's generation (if still running)."""
        for choice in self.choices:
            choice.stream.close()
        self._receive.close()
        self._send.close()

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[Choice, StreamEvent]:
        if not self._forwarding:
            self._forwarding = True
            for choice in self.choices:
                self._nursery.start_soon(_forward, choice, self._send.clone())
            self._send.close()
        try:
            choice, event = await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        if isinstance(event, TokenDelta):
            choice.completion_tokens += len(event.token_ids)
        return choice, event

    def usage(self) -> Usage:
        """The response's usage: each prompt once, every choice's completion tokens."""
        prompt = cached = completion = 0
        seen: set[int] = set()
        for choice in self.choices:
            finished = choice.finished
            completion += finished.completion_tokens if finished else choice.completion_tokens
            if choice.prompt_index not in seen:
                seen.add(choice.prompt_index)
                prompt += choice.prompt_tokens
                cached += finished.cached_prompt_tokens if finished else 0
        return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)

    def all_ended_normally(self) -> bool:
        return all(c.finished is not None and c.finished.reason in NORMAL_ENDS
                   for c in self.choices)

    def failure_error(self) -> ApiError:
        """A non-streaming request one of whose choices ended without a normal finish."""
        for choice in self.choices:
            stream, finished = choice.stream, choice.finished
            if stream.active.abort_reason or (finished is not None
                                              and finished.reason == "cancelled"):
                return shutting_down()
            if finished is not None and finished.reason == "error":
                return internal_error(finished.message or "generation failed")
        return internal_error(self.early_end_message())

    def early_end_message(self) -> str:
        """Why the stream ends without every choice finishing normally."""
        for choice in self.choices:
            stream, finished = choice.stream, choice.finished
            if stream.active.abort_reason:
                return stream.active.abort_reason
            if finished is not None and finished.reason not in NORMAL_ENDS:
                return finished.message or f"generation ended: {finished.reason}"
        return next((c.stream.early_end_message() for c in self.choices
                     if c.finished is None), "generation ended unexpectedly")


async def _forward(choice: Choice,
                   send: trio.MemorySendChannel[tuple[Choice, StreamEvent]]) -> None:
    async with send:
        try:
            async for event in choice.stream:
                await send.send((choice, event))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the reader closed: ``Choices.close`` ends the generation itself
