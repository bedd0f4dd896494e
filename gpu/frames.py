"""Host input and output values of the prepared programs, one type per program kind.

A frame's host inputs travel to ``Backend.launch(program, inputs)`` as the mapping
``{FRAME_KEY: <frame value>}`` (see ``as_inputs``); the program's ``bind`` validates the
value, applies its per-lane state updates in stream order (initialise a row for a new
request; append page ids to a row's block table) and copies the rest into its static
buffers. ``read_outputs`` returns ``{RESULT_KEY: <result value>}`` (see ``result_of``).

Conventions shared by every kind:

- *state rows* are indices into the device request state (``0..state_rows-1``);
- a row's *position* counts the tokens already in its KV cache; its *pending token*
  is the next token to feed (the last sampled one);
- the RNG position of a sampled token is its sequence index, so sampling is keyed by
  (request seed, position) and does not depend on the rest of the batch;
- lanes are dense: lane ``i`` of a frame is ``rows[i]``; physical lanes past
  ``len(rows)`` are padding and mutate nothing (MIX-15).

All values are frozen, slotted, keyword-only dataclasses with tuples (house style).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

FRAME_KEY = "frame"
"""Key of the frame value in the ``inputs`` mapping a backend passes to ``bind``."""

RESULT_KEY = "result"
"""Key of the result value in the mapping ``read_outputs`` returns."""

PEER_OUTPUTS_KEY = "peer_outputs"
"""Under tensor parallelism: the other ranks' ``read_outputs`` mappings, rank order
(``gpu.backends.tensor_parallel``); absent on one rank."""

TOP_LOGPROBS = 20
"""Alternatives a program computes per sampled token and per scored prompt token
(the most OpenAI ``logprobs`` / ``top_logprobs`` allow); the host keeps the first k a
request asked for. Eager step programs compute only the most any row of the frame asks
for (``RowInit.top_logprobs``)."""

Alternatives = tuple[tuple[int, float], ...]
"""The most likely tokens at one place, best first: ``(token id, logprob)`` pairs."""

NO_PROMPT_ROW = -1
"""``prefill_row`` value meaning a mixed frame has no prompt row (MIX-9)."""


class FrameError(ValueError):
    """Raised by ``bind`` when a frame does not fit its program (wrong kind, too many
    lanes or tokens, an invalid prompt row, a row or page out of range). Nothing has
    been written to device state when it is raised."""


# ---------------------------------------------------------------- state updates


MAX_LOGIT_BIAS_ENTRIES = 300
"""Most ``logit_bias`` entries one request may carry (OpenAI's own limit)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request sampling, as a request asks for it and as a state row runs it.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off; the defaults are
    OpenAI's (temperature 1). ``seed`` makes sampling reproducible whatever else is in the
    batch; a request without one (None) gets one drawn at admission, so a state row is
    always initialised with a seed. Values are checked where they enter: admission
    refuses what ``problem`` names, and a row refuses unseeded or invalid parameters
    (``check_row``).

    Logit processing (``gpu.sampling.process_logits``, applied before the greedy
    argmax and before temperature, as vLLM does), all off at their defaults:
    ``presence_penalty`` / ``frequency_penalty`` subtract ``p * [count > 0]`` /
    ``f * count`` from each token's logit, counting the request's *output* tokens;
    ``repetition_penalty`` divides positive (multiplies negative) logits of every token
    seen in the prompt or the output; ``logit_bias`` adds ``(token id, bias)``;
    ``min_tokens`` forbids the tokens that would end the request (EOS and
    ``stop_token_ids``) until that many tokens were generated. ``min_p`` keeps tokens
    whose temperature-scaled probability is at least ``min_p`` times the most likely
    one's (a filter next to top-k and top-p). ``stop_token_ids`` end the request like
    EOS (finish reason ``stop``, the token is not part of the text). Token ids are
    checked against the vocabulary where it is known (admission)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def problem(self) -> str | None:
        """The first reason these parameters can never be run, or None."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            return f"temperature must be finite and >= 0, got {self.temperature}"
        if not 0 < self.top_p <= 1:
            return f"top_p must lie in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return "seed must lie in 0..2**63-1"
        return self._processing_problem()

    def _processing_problem(self) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails too
                return f"{name} must lie in [-2, 2], got {value}"
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            return f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must lie in [0, 1], got {self.min_p}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            return f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries"
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            return "logit_bias names a token id twice"
        for token, bias in self.logit_bias:
            if token < 0:
                return f"logit_bias token ids must be >= 0, got {token}"
            if not -100.0 <= bias <= 100.0:
                return f"logit_bias values must lie in [-100, 100], got {bias}"
        if self.min_tokens < 0:
            return f"min_tokens must be >= 0, got {self.min_tokens}"
        if any(t < 0 for t in self.stop_token_ids):
            return "stop_token_ids must be >= 0"
        return None

    def token_problem(self, vocab_size: int) -> str | None:
        """The first token id (``logit_bias``, ``stop_token_ids``) outside a vocabulary of
        ``vocab_size``, named with its field, or None."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            return f"logit_bias token id {bad} is outside the vocabulary (size {vocab_size})"
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            return f"stop_token_ids id {bad} is outside the vocabulary (size {vocab_size})"
        return None

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processing or the min-p filter is on (False at defaults:
        the programs then skip it, and the result is the same)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_p != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)

    def check_row(self) -> None:
        """Raise ``ValueError`` unless a state row can run these parameters."""
        problem = self.problem()
        if problem is None and self.seed is None:
            problem = "a state row needs a seed"
        if problem is not None:
            raise ValueError(problem)

    @property
    def row_seed(self) -> int:
        """The seed a state row holds; ``ValueError`` when there is none (``check_row``)."""
        if self.seed is None:
            raise ValueError("a state row needs a seed")
        return self.seed


GREEDY = SamplingParams(temperature=0.0, seed=0)
"""Greedy decoding (temperature 0), the default sampling of a row."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RowInit:
    """Initialise ``row`` for a new request (generation): ``position`` tokens are
    already cached (a prefix-cache hit, else 0), the block table is reset to empty."""

    row: int
    position: int = 0
    pending_token: int = 0
    sampling: SamplingParams = GREEDY
    prompt_tokens: tuple[int, ...] = ()
    """The request's prompt tokens, for ``repetition_penalty`` (which penalises tokens
    seen in the prompt, cached prefix included); only needed when it is on."""
    end_token_ids: tuple[int, ...] = ()
    """Every token id that ends the request (EOS unless ignored, ``stop_token_ids``),
    forbidden while fewer than ``sampling.min_tokens`` tokens were generated; only
    needed when ``min_tokens`` is on."""
    grammar: str = ""
    """The request's compiled grammar (llguidance's text) when the programs hold it
    resident (``gpu.grammar_rows``); empty: the row has no resident grammar."""
    top_logprobs: int = TOP_LOGPROBS
    """How many top alternatives the row's samples must carry (0..``TOP_LOGPROBS``):
    eager programs compute only the most any row of a frame asks for, so a frame of
    rows that ask for none skips them."""

    def __post_init__(self) -> None:
        self.sampling.check_row()
        if not 0 <= self.top_logprobs <= TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must lie in 0..{TOP_LOGPROBS}, "
                             f"got {self.top_logprobs}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PageAppend:
    """Set blocks ``first_block, first_block+1, ...`` of ``row``'s block table to ``page_ids``."""

    row: int
    first_block: int
    page_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PageCopy:
    """Copy page ``src_page`` into ``dst_page`` in every pool the block tables address
    (the target's KV, a learned draft's): ``row``'s private copy of a cached page it
    will write into (a prompt found whole in the prefix cache; ``actors.resource_book``)."""

    row: int
    src_page: int
    dst_page: int


StateUpdate = RowInit | PageAppend | PageCopy


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageSpan:
    """One image of a prompt: its feature tokens fill prompt positions
    ``start..start+tokens-1`` (the expanded placeholder). ``digest`` identifies its
    pixels (equal pixels, equal digest); ``image`` is the decoded image (a Pillow
    image) the vision program preprocesses and encodes."""

    digest: str
    image: Any
    start: int
    tokens: int


# ---------------------------------------------------------------- frames (inputs)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillFrame:
    """One prompt chunk of one request (``GraphKind.PREFILL`` / ``SCORED_PREFILL``).

    ``tokens`` are written at positions ``start_position..``; when ``ends_prompt`` the
    program samples the first output token into the row's pending token. For scored
    prefill, ``following_token`` is the prompt token after this chunk (-1 if none), so
    that every chunk token's *successor* can be scored.
    """

    row: int
    tokens: tuple[int, ...]
    start_position: int
    ends_prompt: bool
    following_token: int = -1
    updates: tuple[StateUpdate, ...] = ()
    token_masks: tuple[tuple[int, bytes], ...] = ()
    """``(row, bitmask)`` for the lanes whose grammar constrains the token they sample
    (``gpu.grammar_mask``: one bit per vocabulary entry, little-endian int32 words)."""
    images: tuple[ImageSpan, ...] = ()
    """The prompt's images this chunk covers (their features replace those
    positions' token embeddings; ``gpu.programs.vision``)."""
    copies: tuple[RowCopy, ...] = ()
    """Row copies run in order before ``updates`` (a window snapshot of the row into
    its private snapshot row, then the restore; their sampling is the copied row's)."""
    grammar_rows: tuple[int, ...] = ()
    """Rows whose resident grammar (``gpu.grammar_rows``) constrains the token they
    sample: the program computes their masks in ``bind``, from the tokens sampled so far."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeFrame:
    """One ordinary decode step for each of ``rows`` (``GraphKind.DECODE``).

    Tokens and positions come from device state, so a decode frame may be queued
    behind another decode frame.
    """

    rows: tuple[int, ...]
    updates: tuple[StateUpdate, ...] = ()
    token_masks: tuple[tuple[int, bytes], ...] = ()
    """``(row, bitmask)`` for the lanes whose grammar constrains the token they sample
    (``gpu.grammar_mask``: one bit per vocabulary entry, little-endian int32 words)."""
    grammar_rows: tuple[int, ...] = ()
    """Rows whose resident grammar (``gpu.grammar_rows``) constrains the token they
    sample: the program computes their masks in ``bind``, from the tokens sampled so far."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MixedFrame:
    """One mixed execution (``GraphKind.MIXED``, seed *Mixed execution contract*).

    ``rows`` is the dense active lane list; ``prefill_row`` the prompt row's index in it
    (-1: none, MIX-9). Decode lanes feed their pending token (query length = W = 1);
    the prompt lane's query length is ``len(prompt_tokens)``. Packed offsets are prefix
    sums of the query lengths (MIX-12).
    """

    rows: tuple[int, ...]
    prefill_row: int = NO_PROMPT_ROW
    prompt_tokens: tuple[int, ...] = ()
    prompt_start: int = 0
    prompt_ends: bool = False
    updates: tuple[StateUpdate, ...] = ()
    token_masks: tuple[tuple[int, bytes], ...] = ()
    """``(row, bitmask)`` for the lanes whose grammar constrains the token they sample
    (``gpu.grammar_mask``: one bit per vocabulary entry, little-endian int32 words)."""
    images: tuple[ImageSpan, ...] = ()
    """The prompt lane's images this chunk covers (as ``PrefillFrame.images``)."""
    copies: tuple[RowCopy, ...] = ()
    """Row copies run before ``updates`` (as ``PrefillFrame.copies``)."""
    grammar_rows: tuple[int, ...] = ()
    """Rows whose resident grammar (``gpu.grammar_rows``) constrains the token they
    sample: the program computes their masks in ``bind``, from the tokens sampled so far."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RowCopy:
    """Copy request state ``src_row -> dst_row``. Full pages are shared by reference
    (the block table is copied); the partial last page, if the row has one, is copied
    into ``dst_page`` (-1: the row has no partial page, PRE-37). ``sampling``, when
    given, replaces the copied sampling parameters and seed: a prompt checkpoint
    restored for a new request generation samples with that request's own."""

    src_row: int
    dst_row: int
    dst_page: int = -1
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        if self.sampling is not None:
            self.sampling.check_row()
            if self.sampling.processes_logits:
                # the copied row's penalty state belongs to the source's request
                raise ValueError("a row copy cannot replace sampling with logit processing "
                                 "(initialise the row instead)")


@dataclass(frozen=True, slots=True, kw_only=True)
class StateOpFrame:
    """``GraphKind.STATE`` lanes: SNAPSHOT/RESTORE use ``copies``; PAGE_COPY uses
    ``page_pairs`` (src, dst); INITIALIZE only applies ``updates``."""

    copies: tuple[RowCopy, ...] = ()
    page_pairs: tuple[tuple[int, int], ...] = ()
    updates: tuple[StateUpdate, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionFrame:
    """``GraphKind.VISION``: encode ``images`` (at most the program's image capacity)
    into feature storage, where the prompt frames that cover them read their features
    (``gpu.programs.vision``). Its result is a ``StateOpResult`` (setup, no samples)."""

    images: tuple[ImageSpan, ...]


Frame = PrefillFrame | DecodeFrame | MixedFrame | StateOpFrame | VisionFrame


# ---------------------------------------------------------------- results (outputs)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneSample:
    """What one lane sampled: the token, its log-probability under the model's
    (temperature-1, unfiltered) distribution (``gpu.sampling.reported_log_probs``), or
    under the one it was drawn from with ``ExecutionOptions.processed_logprobs``
    (``gpu.sampling.processed_log_probs``), whether every logit was finite, and the ``TOP_LOGPROBS`` most likely tokens with
    their log-probabilities (best first)."""

    row: int
    token: int
    logprob: float
    finite: bool
    top_logprobs: Alternatives = ()
    draft_proposal: int = -1
    """The learned draft's greedy proposal for this token (its argmax where the lane's
    pending token was fed to it), when a width-one step kept the draft context
    (``gpu.draft_state``); -1 otherwise. A depth-one counterfactual round for greedy
    requests (``docs/speculative-selection.md``, *Counterfactual rounds*)."""
    draft_acceptance: float = -1.0
    """For a sampled lane of such a step: ``sum_x min(p(x), q(x))`` of the target's and
    the draft's filtered distributions for this token, the probability that a
    depth-one round would have accepted its draft (rejection sampling accepts a draft
    ``x ~ q`` with probability ``min(1, p(x)/q(x))``); -1 where not computed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """Result of a prefill, decode or mixed execution.

    ``samples`` holds one entry per lane that sampled (decode lanes always; a prompt
    lane only when its chunk ends the prompt), in lane order. ``prompt_logprobs``
    (scored prefill only) holds, for chunk token ``i``, the log-probability of the
    next prompt token (the last entry is NaN when ``following_token`` is -1), and
    ``prompt_top_logprobs[i]`` the ``TOP_LOGPROBS`` most likely tokens at that place.
    """

    samples: tuple[LaneSample, ...]
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[Alternatives, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StateOpResult:
    """Result of a state operation or a vision execution: how many lanes (images) it
    applied."""

    lanes: int


Result = StepResult | StateOpResult


def as_inputs(frame: Frame) -> dict[str, Any]:
    """The ``inputs`` mapping to pass to ``Backend.launch`` for ``frame``."""
    return {FRAME_KEY: frame}


def frame_of(inputs: Mapping[str, Any]) -> Frame:
    """The frame value inside a ``bind`` inputs mapping (raises ``FrameError``)."""
    frame = inputs.get(FRAME_KEY)
    if not isinstance(frame, PrefillFrame | DecodeFrame | MixedFrame | StateOpFrame
                      | VisionFrame):
        raise FrameError(f"inputs must map {FRAME_KEY!r} to a gpu.frames frame value")
    return frame


class Readout(Protocol):
    """Outputs copied off the device by ``read_outputs`` whose Python result objects
    are built later, by the reader (``result_of``), instead of on the stream."""

    def result(self) -> Result: ...


def result_of(outputs: Mapping[str, Any]) -> Result:
    """The result value inside a ``read_outputs`` mapping (a ``Readout`` is built
    here, on the reader's thread)."""
    result = outputs[RESULT_KEY]
    if not isinstance(result, StepResult | StateOpResult) and hasattr(result, "result"):
        result = result.result()
    if not isinstance(result, StepResult | StateOpResult):
        raise TypeError(f"outputs[{RESULT_KEY!r}] is not a gpu.frames result")
    return result
