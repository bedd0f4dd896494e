"""Speculative decode rows in wider mixed programs (seed: *Mixed execution contract*).

A ``speculation_enabled`` mixed shape ``(B, W > 1, C)`` runs at most one prompt chunk
of up to ``C`` tokens and speculative decode lanes of up to ``W`` rows each, all in
``P = C + (B - 1) * W`` packed rows of one program (MIX-12, MIX-33). This module owns
its candidates and their plans:

- for each shape, the best decode-only cohort (``B`` lanes; ``P >= B * W``, so a
  decode-only population always fits, MIX-17) and the best prompt row plus the
  highest-value decoders fitting the rows its chunk leaves (``B - 1`` lanes,
  ``P - chunk`` rows; MIX-18..20); a prompt-only population is legal (MIX-19);
- decoders are host-allocated (``QueryLength`` semantics: each lane's rows are fixed
  before proposal) at complete ceilings ``min(limit, W)``: a chunk is at most ``C``, so
  ``P`` never binds, and the best cohort is the top lanes by value over the program
  (``rounds.top_cohorts``, SEL-25); their expected output is the same
  ``1 + sum(s_i ** alpha)`` a separate round earns (ACC-1..3), and prefixes are
  complete in either mode (MIX-7, LRN-10);
- every candidate is priced as useful value per full graph duration, with the same lane
  values as every other candidate; padding earns nothing (MIX-21); unknown durations
  rank first by useful value (DUR-22, DUR-23), so a wider mixed program is discovered
  like any other;
- ``mixed_round_plan``: the frozen plan (the prompt lane first, ``MixedRole(prefill_row,
  DecodeMode.SPECULATIVE)``); a mixed frame needs an empty window and nothing queues
  behind it (MIX-31, QUEUE-11).

The prompt row is chosen as ordinary mixed selection chooses it (``policy/candidates``):
the ordinary (unscored) prompt whose chunk ``min(remaining, C)`` is worth most, ties to
the least recently served (DUR-24).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policy.decision_context import PromptGroup
from policy.descriptors import GraphKind, GraphShape
from policy.requests import RequestRecord
from policy.round_cohorts import HostCohort, cohort_round, top_cohorts
from policy.round_plans import ranked_plan
from policy.round_table import LaneTable, RoundCandidate
from policy.rounds import plan_lanes
from policy.types import (
    DecodeMode,
    Lane,
    LaneRole,
    MixedRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.utility import NS_PER_MS, value_rate

__all__ = ["MixedPrompt", "MixedRound", "best_mixed_round", "best_prompt",
           "mixed_round_plan", "wider_mixed_shapes"]


def wider_mixed_shapes(shapes: Sequence[GraphShape]) -> list[GraphShape]:
    """The catalog's wider speculative mixed programs (``W > 1``, MIX-43)."""
    return [s for s in shapes if s.kind is GraphKind.MIXED and s.speculation_enabled
            and s.token_capacity > 1]


@dataclass(frozen=True, slots=True)
class MixedPrompt:
    """One prompt row of a mixed frame: ``tokens`` from the request's prompt cursor,
    worth ``value`` (scaled prefill price per token, plus the first output's value when
    the chunk ends the prompt, ``final``)."""

    record: RequestRecord
    tokens: int
    value: float
    final: bool

    def lane(self) -> Lane:
        """The plan's prompt lane (as ordinary mixed plans build it)."""
        rec, final = self.record, self.final
        return Lane(handle=rec.handle, epoch=rec.epoch, role=LaneRole.PROMPT,
                    prompt_start=rec.prompt_cursor, prompt_tokens=self.tokens,
                    token_ceiling=1 if final else 0, expected_tokens=1.0 if final else 0.0,
                    expected_deliveries=1.0 if final else 0.0, value=self.value)


def best_prompt(prompts: PromptGroup, capacity: int) -> MixedPrompt | None:
    """The ordinary prompt row worth most with a chunk of at most ``capacity`` tokens;
    rows come least recently served first, so the first maximum wins ties (DUR-24)."""
    best: MixedPrompt | None = None
    for pos in prompts.ordinary:
        remaining = prompts.remaining[pos]
        tokens = min(remaining, capacity)
        if tokens <= 0:
            continue
        final = tokens == remaining and prompts.reaches[pos]
        value = tokens * prompts.price[pos] + (prompts.finish[pos] if final else 0.0)
        if best is None or value > best.value:
            best = MixedPrompt(record=prompts.records[pos], tokens=tokens, value=value,
                               final=final)
    return best


@dataclass(frozen=True, slots=True)
class MixedRound:
    """A wider mixed candidate: an optional prompt row and an optional speculative
    decode cohort (``decoders``, priced over the mixed program), at least one of them."""

    shape: GraphShape
    prompt: MixedPrompt | None
    decoders: RoundCandidate | None
    estimate_ns: int
    """The mixed program's estimate (0 = unknown)."""
    base: float
    slope: float
    rate: float | None
    """F-SEL value rate; None for an unknown duration."""

    @property
    def useful_value(self) -> float:
        """Scaled useful value including the age earned over the program (DUR-23)."""
        return self.base + self.slope * self.estimate_ns / NS_PER_MS

    @property
    def size(self) -> int:
        return (self.prompt is not None) + (self.decoders.size if self.decoders else 0)


def best_mixed_round(
    table: LaneTable,
    prompts: PromptGroup,
    shapes: Sequence[GraphShape],
    estimates_ns: Sequence[int],
    *,
    waiting: float,
) -> MixedRound | None:
    """The best candidate over the wider mixed ``shapes`` (``estimates_ns`` aligned, 0 =
    unknown) from the decision's ``lane_table``: per shape, the decode-only cohort and
    the best prompt row with the decoders its chunk leaves room for (module
    docstring). ``P`` never binds here, so each cohort is the top lanes at complete
    ceilings (``rounds.top_cohorts``, as a separate host program's unconstrained
    choice). None when nothing fits."""
    specs: list[tuple[int, int, int]] = []
    chosen: list[MixedPrompt | None] = []
    for shape, estimate in zip(shapes, estimates_ns, strict=True):
        b, w = shape.batch_capacity, shape.token_capacity
        prompt = best_prompt(prompts, shape.prefill_capacity)
        chosen.append(prompt)
        specs += [(b, w, estimate), (b - 1 if prompt is not None else 0, w, estimate)]
    cohorts = top_cohorts(table, specs)
    best: tuple[tuple[float, ...], GraphShape, MixedPrompt | None, HostCohort | None,
                int, float, float, float | None] | None = None
    for k, (shape, estimate) in enumerate(zip(shapes, estimates_ns, strict=True)):
        prompt = chosen[k]
        options: list[tuple[MixedPrompt | None, HostCohort | None]] = (
            [(None, cohorts[2 * k])] if cohorts[2 * k] is not None else [])
        if prompt is not None:
            options.append((prompt, cohorts[2 * k + 1]))
        for option_prompt, cohort in options:
            base = (option_prompt.value if option_prompt else 0.0) + (
                cohort.base if cohort else 0.0)
            slope = cohort.slope if cohort else 0.0
            t_ms = estimate / NS_PER_MS
            rate = value_rate(base, slope, t_ms, waiting) if estimate > 0 else None
            size = (option_prompt is not None) + (len(cohort.cohort) if cohort else 0)
            rows = (option_prompt.tokens if option_prompt else 0) + (
                sum(cohort.rows) if cohort else 0)
            # unknown durations by useful value, then rate, shorter time, more lanes,
            # less padding (DUR-22..24)
            key = (float(rate is not None),
                   -(rate if rate is not None else base + slope * t_ms), float(estimate),
                   -float(size), float(shape.packed_capacity - rows))
            if best is None or key < best[0]:
                best = (key, shape, option_prompt, cohort, estimate, base, slope, rate)
    if best is None:
        return None
    _, shape, prompt, cohort, estimate, base, slope, rate = best
    decoders = cohort_round(shape, table, cohort, estimate, waiting) if cohort else None
    return MixedRound(shape=shape, prompt=prompt, decoders=decoders, estimate_ns=estimate,
                      base=base, slope=slope, rate=rate)


def mixed_round_plan(candidate: MixedRound, *, reason: SelectionReason, exponent: int,
                     stale: bool, now_ns: int, start_ns: int) -> ScheduledPlan:
    """The frozen plan: the prompt lane first (``prefill_row`` 0, or -1 without one),
    then the decode lanes in slot order with their host-fixed rows as ceilings."""
    lanes: list[Lane] = [candidate.prompt.lane()] if candidate.prompt is not None else []
    if candidate.decoders is not None:
        lanes.extend(plan_lanes(candidate.decoders))
    step = ScheduledStep(shape=candidate.shape, lanes=tuple(lanes), mixed=MixedRole(
        prefill_row=0 if candidate.prompt is not None else -1,
        decode_mode=DecodeMode.SPECULATIVE))
    # not a generation frame: it drains the window (MIX-31, QUEUE-11)
    return ranked_plan(candidate, step, reason=reason, exponent=exponent, stale=stale,
                       now_ns=now_ns, start_ns=start_ns, requires_empty_window=True)
