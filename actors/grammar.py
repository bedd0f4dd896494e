"""Structured output on the host: a request's ``GrammarSpec`` compiled by llguidance,
and one matcher per constrained request that says which tokens may come next.

Owns three things:

- **Compilation** (``compile_grammar``, ``grammar_problem``): a spec becomes an
  llguidance grammar. JSON is compact (no free whitespace between tokens): a tiny or
  unsure model could otherwise spend its whole budget on blanks.
- **The vocabulary** (``GrammarVocabulary``): the checkpoint's ``tokenizer.json``
  wrapped once per runtime as an ``LLTokenizer`` over the model's logit width, with
  the end-of-sequence tokens the grammar may allow where it can end.
- **Matcher state** (``RequestGrammar``): advanced with every token the host has
  validated, in order; ``mask`` is the bitmask of the tokens allowed next (one bit per
  vocabulary entry, little-endian 32-bit words, the layout ``gpu.grammar_mask``
  applies on the device). With host grammars a constrained request's next frame is
  built only after its previous token is known here (completion feedback, QUEUE-13);
  where the programs hold resident grammars (``gpu.grammar_rows``) this matcher only
  validates the tokens and ends the request when the grammar is complete.

Never touches the device or trio; llguidance releases the GIL while it computes a mask.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import numpy as np

from actors.public import GrammarSpec

_JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON: separators without blanks (what ``json.dumps(..., separators=(",",
":"))`` writes); the output still parses with any JSON reader."""

_ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """Raised when a ``GrammarSpec`` does not compile (a bad schema, regex, choice list
    or grammar); the message says why."""


def compile_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec`` (raises ``GrammarError``)."""
    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                _ANY_OBJECT, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) for c in choices)):
                raise GrammarError("choices must be a non-empty list of strings")
            return llguidance.grammar_from("choice", spec.source)
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.source)
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise GrammarError(str(exc)) from exc
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def grammar_problem(spec: GrammarSpec) -> str | None:
    """Why ``spec`` cannot constrain a request (a short message), or None when it
    compiles. Checks the grammar itself, not the vocabulary."""
    try:
        grammar = compile_grammar(spec)
    except GrammarError as exc:
        return str(exc)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    return _first_line(problem) if problem else None


def load_vocabulary(tokenizer_json: str, *, vocab_size: int, eos_token_ids: Sequence[int]
                    ) -> tuple[GrammarVocabulary | None, str]:
    """The runtime's grammar vocabulary, or None and why structured output is then
    unavailable (the server still serves everything else)."""
    try:
        return GrammarVocabulary(tokenizer_json, vocab_size=vocab_size,
                                 eos_token_ids=eos_token_ids), ""
    except GrammarError as exc:
        return None, f"structured output is not available: {exc}"


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


class GrammarVocabulary:
    """The served vocabulary as llguidance sees it (built once per runtime; raises
    ``GrammarError`` for a tokenizer llguidance cannot read).

    ``tokenizer_json``: the checkpoint's ``tokenizer.json`` text; ``vocab_size``: the
    model's logit width (masks have one bit per logit); ``eos_token_ids``: the tokens
    that end a request, allowed where the grammar may end.
    """

    def __init__(self, tokenizer_json: str, *, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        """32-bit words per mask."""
        self.eos_token_ids = tuple(eos_token_ids)
        try:
            self._tokenizer = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=vocab_size,
                eos_token=list(self.eos_token_ids) or None)
        except ValueError as exc:  # e.g. a tokenizer without a byte-level decoder
            raise GrammarError(f"the tokenizer is not one llguidance reads: {exc}") from exc
        self._executor: llguidance.LLExecutor | None = None
        """Threads for a frame's masks (``masks``), started with the first batch."""

    def masks(self, grammars: Sequence[RequestGrammar]) -> list[bytes]:
        """The next-token masks of several matchers (one frame's constrained lanes),
        computed in parallel by llguidance's executor threads, without the GIL."""
        if len(grammars) < 2:
            return [g.mask() for g in grammars]
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        out = np.empty((len(grammars), self.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(g._matcher, i) for i, g in enumerate(grammars)], out.ctypes.data,
            self.words * 4, len(grammars))
        for g in grammars:
            g.check()
        return [row.tobytes() for row in out]

    def problem(self, spec: GrammarSpec) -> str | None:
        """Why ``spec`` cannot constrain a request on this vocabulary, or None."""
        try:
            self.matcher(spec)
        except GrammarError as exc:
            return str(exc)
        return None

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher for one request (raises ``GrammarError``)."""
        source = compile_grammar(spec)
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return RequestGrammar(matcher, self, source)


class RequestGrammar:
    """One constrained request's matcher: the tokens it has accepted so far decide
    the mask of the next."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: GrammarVocabulary,
                 source: str) -> None:
        self._matcher = matcher
        self._vocabulary = vocabulary
        self.source = source
        """The compiled grammar (llguidance's text): what a resident copy of this
        matcher is built from where the frames run (``gpu.grammar_rows``)."""

    def mask(self) -> bytes:
        """The bitmask of the tokens allowed next (``words`` little-endian int32)."""
        out = np.empty(self._vocabulary.words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self.check()
        return out.tobytes()

    def check(self) -> None:
        """Raise ``GrammarError`` if the matcher is in error (its mask is meaningless)."""
        if self._matcher.is_error():
            raise GrammarError(_first_line(self._matcher.get_error()))

    def accept(self, token: int) -> bool:
        """Advance past a validated token; False when the grammar refuses it (the
        matcher is then in error and the request must fail)."""
        if token in self._vocabulary.eos_token_ids and self._matcher.is_accepting():
            return True
        return bool(self._matcher.consume_token(token))

    @property
    def vocabulary(self) -> GrammarVocabulary:
        return self._vocabulary

    @property
    def complete(self) -> bool:
        """Nothing but end-of-sequence may follow: the request is done."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return _first_line(self._matcher.get_error())


def request_matcher(vocabulary: GrammarVocabulary | None, spec: GrammarSpec | None
                    ) -> RequestGrammar | None:
    """A fresh matcher for a constrained request (admission checked that its grammar
    compiles and that the runtime has a vocabulary for it); None when unconstrained."""
    if spec is None:
        return None
    if vocabulary is None:
        raise GrammarError("this runtime has no grammar vocabulary")
    return vocabulary.matcher(spec)
