"""Counterfactual copy rounds: what copy proposals would have accepted where none ran.

The copy proposal source (``gpu/speculative/copy_proposals.py``, SPEC-8) is a pure
function of a request's own tokens: find the most recent earlier occurrence of the
context's last ``n`` tokens (longest ``n`` first) and propose what followed it. So the
host can replay it. When a frame advances a request without verifying copy drafts (a
decode, a width-one round, a round whose lookup found nothing), ``CopyCounterfactuals``
records the drafts a copy round starting from that frame's context would have
proposed, compares them with the tokens the target then produced, and reports one
``(offered, accepted)`` observation per such frame once it is decided: at the first
mismatch, when every draft matched, or censored when the request ends first (ACC-8).
The planner feeds them to ``SchedulingPolicy.observe_counterfactual``.

The lookup is incremental: a dictionary from each n-gram to the end of its most recent
occurrence, extended as tokens arrive, so a frame costs ``max_ngram`` lookups however
long the context (``reference_copy_proposal`` is the direct search it must equal).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Observation = tuple[int, int]
"""``(offered, accepted)``: drafts a counterfactual round offered, and how many of them
(a prefix) equalled the tokens that followed."""


@dataclass(slots=True)
class _Pending:
    drafts: tuple[int, ...]
    matched: int = 0


@dataclass(slots=True)
class CopyCounterfactuals:
    """One request's context, its n-gram index and its undecided counterfactual rounds."""

    depth: int
    """Drafts per counterfactual round: the deepest copy round the catalog can run."""
    max_ngram: int
    min_ngram: int = 1
    _context: list[int] = field(init=False, default_factory=list)
    _last_end: dict[tuple[int, ...], int] = field(init=False, default_factory=dict)
    """n-gram -> end index of its most recent occurrence among those indexed."""
    _indexed_through: int = field(init=False, default=-1)
    """n-grams ending at indices up to this one are in ``_last_end``."""
    _pending: list[_Pending] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.depth < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need depth >= 1 and 1 <= min_ngram <= max_ngram, got "
                             f"{self.depth}, {self.min_ngram}, {self.max_ngram}")

    @classmethod
    def starting_from(cls, context: Iterable[int], *, depth: int, max_ngram: int,
                      min_ngram: int = 1) -> CopyCounterfactuals:
        """A tracker for a request whose context (prompt, then output) is ``context``."""
        tracker = cls(depth=depth, max_ngram=max_ngram, min_ngram=min_ngram)
        tracker._context = list(context)
        return tracker

    @property
    def undecided(self) -> int:
        """Counterfactual rounds still waiting for tokens."""
        return len(self._pending)

    def proposal(self) -> tuple[int, ...]:
        """The drafts a copy round would propose from the current context: the tokens
        after the most recent earlier occurrence of its last ``n`` tokens (an occurrence
        ending before the last token), longest ``n`` first, at most ``depth``."""
        context = self._context
        size = len(context)
        self._index_through(size - 2)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if size < n + 1:
                continue
            end = self._last_end.get(tuple(context[size - n:]))
            if end is not None:
                return tuple(context[end + 1: min(end + 1 + self.depth, size)])
        return ()

    def open_round(self) -> None:
        """A frame is about to extend the context without verifying copy drafts: keep
        what a copy round from here would have proposed (nothing when the lookup finds
        no match: such a round offers nothing, ACC-9)."""
        drafts = self.proposal()
        if drafts:
            self._pending.append(_Pending(drafts))

    def extend(self, tokens: Sequence[int]) -> list[Observation]:
        """Append generated tokens; the counterfactual rounds they decide."""
        decided: list[Observation] = []
        for token in tokens:
            self._context.append(token)
            undecided: list[_Pending] = []
            for round_ in self._pending:
                if round_.drafts[round_.matched] != token:
                    decided.append((len(round_.drafts), round_.matched))
                    continue
                round_.matched += 1
                if round_.matched == len(round_.drafts):
                    decided.append((len(round_.drafts), round_.matched))
                else:
                    undecided.append(round_)
            self._pending = undecided
        return decided

    def terminate(self) -> list[Observation]:
        """The request ended: each undecided round observes its matched prefix only
        (the caller passes ``terminated=True``: the rest is censored, ACC-8)."""
        decided = [(len(r.drafts), r.matched) for r in self._pending]
        self._pending = []
        return decided

    def _index_through(self, last: int) -> None:
        """Index the n-grams ending at indices up to ``last``."""
        context = self._context
        for end in range(self._indexed_through + 1, last + 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self._last_end[tuple(context[end - n + 1: end + 1])] = end
        self._indexed_through = max(self._indexed_through, last)
