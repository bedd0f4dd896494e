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
  before proposal) by ``rounds.host_round``, so their expected output is the same
  ``1 + sum(s_i ** alpha)`` a separate round earns (ACC-1..3); fixed mode keeps
  complete prefixes (MIX-7, LRN-10);
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
from policy.rounds import (
    RoundCandidate,
    SpeculationMode,
    SpeculativeLane,
    host_round,
    lane_table,
    plan_lanes,
)
from policy.types import (
    DecodeMode,
    Lane,
    LaneRole,
    MixedRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.utility import NS_PER_MS, optimistic_rate, value_rate

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

    def rank(self) -> tuple[float, ...]:
        """Best first: unknown durations by useful value, then value rate, shorter time,
        more lanes, less padding (DUR-22..24)."""
        known = self.rate is not None
        primary = self.rate if self.rate is not None else self.useful_value
        rows = (self.prompt.tokens if self.prompt else 0) + (
            self.decoders.rows_used if self.decoders else 0)
        return (float(known), -primary, float(self.estimate_ns), -float(self.size),
                float(self.shape.packed_capacity - rows))


def _priced(shape: GraphShape, prompt: MixedPrompt | None, decoders: RoundCandidate | None,
            estimate_ns: int, waiting: float) -> MixedRound:
    base = (prompt.value if prompt else 0.0) + (decoders.base if decoders else 0.0)
    slope = decoders.slope if decoders else 0.0
    rate = value_rate(base, slope, estimate_ns / NS_PER_MS, waiting) if estimate_ns > 0 \
        else None
    return MixedRound(shape=shape, prompt=prompt, decoders=decoders, estimate_ns=estimate_ns,
                      base=base, slope=slope, rate=rate)


def best_mixed_round(
    lanes: Sequence[SpeculativeLane],
    prompts: PromptGroup,
    shapes: Sequence[GraphShape],
    estimates_ns: Sequence[int],
    *,
    alpha: float,
    waiting: float,
    mode: SpeculationMode,
) -> MixedRound | None:
    """The best candidate over the wider mixed ``shapes`` (``estimates_ns`` aligned, 0 =
    unknown): per shape, the decode-only cohort and the best prompt row with the
    decoders its chunk leaves room for (module docstring). None when nothing fits."""
    if not shapes:
        return None
    table = lane_table(lanes, max(s.token_capacity for s in shapes), alpha)
    out: list[MixedRound] = []
    for shape, estimate in zip(shapes, estimates_ns, strict=True):
        b, w, p = shape.batch_capacity, shape.token_capacity, shape.packed_capacity
        if table.lanes:
            alone = host_round(shape, table, estimate, waiting, mode, batch=b, packed=p,
                               width=w)
            if alone is not None:
                out.append(_priced(shape, None, alone, estimate, waiting))
        prompt = best_prompt(prompts, shape.prefill_capacity)
        if prompt is not None:
            decoders = host_round(shape, table, estimate, waiting, mode, batch=b - 1,
                                  packed=p - prompt.tokens, width=w) if table.lanes else None
            out.append(_priced(shape, prompt, decoders, estimate, waiting))
    return min(out, key=MixedRound.rank) if out else None


def mixed_round_plan(candidate: MixedRound, *, reason: SelectionReason, exponent: int,
                     stale: bool, now_ns: int, start_ns: int) -> ScheduledPlan:
    """The frozen plan: the prompt lane first (``prefill_row`` 0, or -1 without one),
    then the decode lanes in slot order with their host-fixed rows as ceilings."""
    lanes: list[Lane] = [candidate.prompt.lane()] if candidate.prompt is not None else []
    if candidate.decoders is not None:
        lanes.extend(plan_lanes(candidate.decoders))
    known = candidate.rate is not None
    return ScheduledPlan(
        step=ScheduledStep(shape=candidate.shape, lanes=tuple(lanes), mixed=MixedRole(
            prefill_row=0 if candidate.prompt is not None else -1,
            decode_mode=DecodeMode.SPECULATIVE)),
        estimated_duration_ns=candidate.estimate_ns,
        scaled_score=candidate.rate if candidate.rate is not None
        else optimistic_rate(candidate.useful_value),
        scale_exponent=exponent,
        duration_known=known,
        stale=stale,
        reason=reason,
        requires_empty_window=True,  # not a generation frame (MIX-31, QUEUE-11)
        planned_at_ns=now_ns,
        start_ns=start_ns,
        useful_value=candidate.useful_value,
    )
