"""Turning sampled token ids into visible text: the publisher's pure core.

Owns three decisions, all synchronous and free of trio so tests call them directly:

- ``IncrementalDetokenizer``: decodes a growing id list and only ever releases text
  whose bytes are complete. Byte-level BPE tokenizers can split one character over
  several tokens; decoding such a prefix yields U+FFFD, so the tail is held back
  until a later token completes it. Decoding always restarts a few tokens before the
  released point (``prefix_offset``) because a token's text can depend on its left
  neighbour (leading-space handling, merged byte sequences).
- ``StopStringBuffer``: holds back text only while it could still become a stop
  string (the longest suffix of pending text that is a proper prefix of some stop
  string) and cuts the output at the first complete match.
- ``OutputStream``: one request's output: EOS (unless ``ignore_eos``), ``max_tokens``
  and the finish reason, producing at most one ``TokenDelta`` per published fence
  (seed: Service accounting and publication; ACCT-16, OPEN-20).

It must never do I/O or talk to channels: the publisher actor does that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from actors.public import Alternatives, FinishReason, TokenDelta

REPLACEMENT_CHARACTER = "\ufffd"

DETOKENIZE_CONTEXT_TOKENS = 6
"""Tokens re-decoded left of the released point so that a token's text sees its
neighbour (the value vLLM and TGI use for the same technique)."""

MAX_HELD_TOKENS = 4
"""A UTF-8 character has at most four bytes, so at most four tokens end inside one."""

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Releases the text of a growing token sequence, never a broken character."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        """Start of the window that is re-decoded for context."""
        self._read_offset = 0
        """Tokens before this index have had their text released."""

    @property
    def token_count(self) -> int:
        return len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; return the newly complete text (possibly empty)."""
        self._ids.extend(token_ids)
        if self._read_offset >= len(self._ids):
            return ""
        released = self._decode(self._ids[self._prefix_offset:self._read_offset])
        # Release the longest token prefix whose text ends on a complete character;
        # a split character spans at most four bytes, so at most four tokens are
        # held back.
        lowest = max(self._read_offset, len(self._ids) - MAX_HELD_TOKENS)
        for end in range(len(self._ids), lowest, -1):
            full = self._decode(self._ids[self._prefix_offset:end])
            if full.endswith(REPLACEMENT_CHARACTER) or not full.startswith(released):
                continue
            self._read_offset = end
            self._prefix_offset = max(end - DETOKENIZE_CONTEXT_TOKENS, 0)
            return full[len(released):]
        return ""

    def flush(self) -> str:
        """Release whatever is held back (at finish); incomplete bytes decode as U+FFFD,
        which is still valid UTF-8."""
        if self._read_offset >= len(self._ids):
            return ""
        released = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        return full[len(released):] if full.startswith(released) else full


class StopStringBuffer:
    """Holds back text only while it could still become one of ``stops``."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self._longest = max((len(s) for s in self._stops), default=0)

    @property
    def held_back(self) -> str:
        return self._pending

    def push(self, text: str, *, matching: bool = True) -> tuple[str, bool]:
        """Add ``text``; return ``(visible, stopped)``.

        ``visible`` never contains a stop string nor a suffix that could still grow
        into one. When ``stopped``, ``visible`` is the text before the earliest match
        and everything after it is discarded. With ``matching`` False (text of tokens
        before ``min_tokens``) nothing stops; only a suffix that could still grow into
        a stop is held back.
        """
        if not self._stops:
            return text, False
        pending = self._pending + text
        match = self._earliest_match(pending) if matching else None
        if match is not None:
            self._pending = ""
            return pending[:match], True
        keep = self._held_suffix_length(pending)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """Release the held-back text (the stream ended without a stop string)."""
        text, self._pending = self._pending, ""
        return text

    def _earliest_match(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _held_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[len(text) - length:]
            if any(s.startswith(suffix) for s in self._stops):
                return length
        return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStep:
    """What one published fence did to a request's output."""

    delta: TokenDelta | None
    """Newly visible output, or None when nothing became visible (OPEN-20)."""
    finish: FinishReason | None
    """Set when this fence ended the request's output."""


class OutputStream:
    """One request's output: detokenisation, stop strings, EOS (and the request's
    ``stop_token_ids``) and ``max_tokens``.

    Token accounting: ``completion_tokens`` counts every generated token, an EOS
    included. The EOS token's text is never shown and its id is not part of a delta;
    tokens after a stop-string match were generated (and are counted) but are cut.
    """

    def __init__(
        self,
        *,
        decode: Decode,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        stop: Sequence[str],
        ignore_eos: bool,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(decode)
        self._stops = StopStringBuffer(stop)
        self._max_tokens = max_tokens
        # stop_token_ids end the output like EOS (even with ignore_eos, as in vLLM)
        self._eos = frozenset((*(() if ignore_eos else eos_token_ids), *stop_token_ids))
        # stop strings count from the min_tokens-th token on, as in vLLM (the device
        # already keeps EOS and stop_token_ids out before it)
        self._min_tokens = min_tokens
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[float] = []
        self._pending_top: list[Alternatives] = []
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token_ids: Sequence[int], logprobs: Sequence[float] = (),
             top_logprobs: Sequence[Alternatives] = ()) -> StreamStep:
        """Consume one fence's tokens for this request (in order), with their logprobs
        and alternatives where reported. With ``max_tokens`` 0 (a scored prompt) the
        token that follows the prompt is discarded: nothing is generated."""
        if self.finish_reason is not None:
            return StreamStep(delta=None, finish=None)
        if self._max_tokens == 0:
            self.finish_reason = "length"
            return StreamStep(delta=None, finish="length")
        visible_ids: list[int] = []
        finish: FinishReason | None = None
        # visible tokens numbered below min_tokens: their text cannot stop the output
        unmatched = max(0, self._min_tokens - 1 - self.completion_tokens)
        for index, token in enumerate(token_ids):
            self.completion_tokens += 1
            if token in self._eos:
                finish = "stop"
                break
            visible_ids.append(token)
            if index < len(logprobs):
                self._pending_logprobs.append(float(logprobs[index]))
            if index < len(top_logprobs):
                self._pending_top.append(top_logprobs[index])
            if self.completion_tokens >= self._max_tokens:
                finish = "length"
                break
        self._pending_ids.extend(visible_ids)
        text = ""
        if unmatched:
            text, _ = self._stops.push(self._detokenizer.push(visible_ids[:unmatched]),
                                       matching=False)
            visible_ids = visible_ids[unmatched:]
        tail, stopped = self._stops.push(self._detokenizer.push(visible_ids))
        text += tail
        if stopped:
            finish = "stop"
        elif finish is not None:
            # Nothing more can complete a stop string or a character: release all.
            visible_tail, stopped = self._stops.push(self._detokenizer.flush())
            text += visible_tail if stopped else visible_tail + self._stops.flush()
            if stopped:
                finish = "stop"
        self.finish_reason = finish
        return StreamStep(delta=self._take_delta(text, force=finish is not None), finish=finish)

    def _take_delta(self, text: str, *, force: bool) -> TokenDelta | None:
        if not text and not (force and self._pending_ids):
            return None
        delta = TokenDelta(
            text=text,
            token_ids=tuple(self._pending_ids),
            logprobs=tuple(self._pending_logprobs),
            top_logprobs=tuple(self._pending_top),
        )
        self._pending_ids.clear()
        self._pending_logprobs.clear()
        self._pending_top.clear()
        return delta
