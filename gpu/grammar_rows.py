"""Resident grammars: per-row grammar matchers held where the frames run.

On a backend whose stream runs ``bind -> execute -> read_outputs`` one frame after the
other on the host's CPU (the ``cpu`` backend, in its device process or in-thread), the
grammar of a constrained request can live with the request state instead of on the
serving host: ``RequestState.grammars`` holds one llguidance matcher per row, created
by the row's ``RowInit`` (its ``grammar``: the compiled grammar text), advanced by the
step program with each token the row samples (``advance``, at the end of ``execute``)
and asked for the next mask when a frame lists the row in ``grammar_rows``
(``mask_block``, in ``bind``, in stream order). A frame queued behind another then
finds its mask computed from the token the frame ahead sampled, exactly as its pending
token is: no host feedback, so constrained decode frames keep both frame slots
(``policy.grammar_feedback``, docs/runtime.md *Structured output*).

The serving host keeps its own matcher per request (``actors.grammar``) and still
validates every token against it; the two advance over the same tokens, so they agree.
A matcher that is stopped (the grammar is complete) allows only end-of-sequence, which
is what a decode queued behind a request's final token samples; one in error (a token
it refused, which the host also refuses and fails the lane for) allows everything, so
the frame still runs for its other lanes.

The CUDA backend binds a frame before the frame ahead has finished, so it cannot hold
grammars this way and keeps host masks with completion feedback.

Pickling (the device process receives the state once): only the vocabulary travels;
the tokenizer and matchers are rebuilt where the frames run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from gpu.frames import FrameError, RowInit
from gpu.grammar_mask import ALL_ALLOWED, mask_words


class ResidentGrammars:
    """The matchers of the rows whose requests are grammar-constrained.

    ``tokenizer_json``: the checkpoint's ``tokenizer.json`` text; ``vocab_size``: the
    model's logit width; ``eos_token_ids``: the tokens a complete grammar allows.
    """

    def __init__(self, tokenizer_json: str, *, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._rows: dict[int, llguidance.LLMatcher] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer_json": self._tokenizer_json, "vocab_size": self.vocab_size,
                "eos_token_ids": self.eos_token_ids}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tokenizer_json"], vocab_size=state["vocab_size"],  # type: ignore[misc]
                      eos_token_ids=state["eos_token_ids"])

    def _tokens(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size,
                eos_token=list(self.eos_token_ids) or None)
        return self._tokenizer

    def init_row(self, update: RowInit) -> None:
        """A new request on ``update.row``: its matcher from ``update.grammar``, or none."""
        if not update.grammar:
            self._rows.pop(update.row, None)
            return
        matcher = llguidance.LLMatcher(self._tokens(), update.grammar, log_level=0)
        if matcher.is_error():
            raise FrameError(f"row {update.row}: the grammar does not compile: "
                             f"{matcher.get_error().strip()}")
        self._rows[update.row] = matcher

    def holds(self, row: int) -> bool:
        return row in self._rows

    def mask_block(self, lanes: int, lane_rows: Sequence[tuple[int, int]]) -> np.ndarray:
        """``[lanes, words]`` int32 masks: lane ``i`` of every ``(i, row)`` pair gets
        what its row's matcher allows next, every other lane allows everything.
        Raises ``FrameError`` for a row without a matcher."""
        block = np.full((lanes, self.words), ALL_ALLOWED, dtype=np.int32)
        live: list[tuple[llguidance.LLMatcher, int]] = []
        for lane, row in lane_rows:
            matcher = self._rows.get(row)
            if matcher is None:
                raise FrameError(f"row {row} holds no grammar")
            if not matcher.is_error():
                live.append((matcher, lane))
        if len(live) == 1:
            matcher, lane = live[0]
            matcher.unsafe_compute_mask_ptr(block[lane].ctypes.data, self.words * 4)
        elif live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(live, block.ctypes.data, self.words * 4,
                                                   lanes)
        for matcher, lane in live:
            if matcher.is_error():  # the mask is meaningless: the host fails the lane
                block[lane] = ALL_ALLOWED
        return block

    def advance(self, rows: Sequence[int], tokens: Sequence[int]) -> None:
        """Advance each row's matcher past the token it sampled (end-of-sequence where
        the grammar may end leaves it as it is)."""
        for row, token in zip(rows, tokens, strict=True):
            matcher = self._rows.get(row)
            if matcher is None or matcher.is_error():
                continue
            if token in self.eos_token_ids and matcher.is_accepting():
                continue
            matcher.consume_token(token)
