"""Candidates and selection for one decision (seed module ``policy.rs``).

This module owns the ordinary selector: given a ``DecisionContext`` (scaled lane values
of the runnable requests, built by ``policy/decision.py``; the types live in
``policy/decision_context.py`` and ``policy/catalog_index.py`` and are re-exported here),
it ranks every ordinary candidate (``policy/candidates.py``) against the best
prerequisite candidate (``policy/prerequisites.py``, or for prompt rows with images,
``policy/vision_prerequisites.py``: vision frames and chunks that hold an image whole)
and returns the winner as a frozen
``ScheduledPlan`` with its lanes. The candidate table as first written, one numpy table
ranked by one lexsort, is kept as the executable specification in
``tests/policy/selection_reference.py``.

Rules implemented here (seed: *Useful service and selection*, *Duration estimates*,
*Funded timing refresh*, *Mixed execution contract*):

- every loaded capacity competes (SEL-24, SEL-36, SEL-42, SEL-43); prefill capacities
  earn only the tokens they can consume up to the logical end (SEL-39..41);
- cohorts are the highest additive lane values (SEL-25): decoders and terminal rows are
  sorted once, so a cohort of size m is the first m of that order and its value is a
  prefix sum (no subset enumeration, SEL-38); at most 64 rows (SEL-31);
- mixed shapes compare the best decode-only cohort with the best prompt row plus the
  highest-value decoders fitting the remaining rows (MIX-18..21);
- dominance: same kind, cohort and logical work -> drop any shape whose capacities are
  all >= another's with one strictly larger (SEL-32, SEL-33, SEL-35);
- prefill exploration excludes a larger unmeasured graph when a smaller capacity covers
  the tokens up to the next message or prompt endpoint (DUR-20, OPEN-30);
- ranking: unknown durations first, by useful value (DUR-22, DUR-23); known ones by F-SEL
  value rate; ties by shorter known time, more served requests, less recently used
  requests, smaller padding (DUR-24, OPEN-19);
- funded timing refresh: with full credit, the least recently touched stale alternative
  displaces a measured winner (REF-7, REF-8, OPEN-9); refresh candidates may include
  padded (dominated) shapes because refresh is separate from ordinary selection (SEL-37).
"""

from __future__ import annotations

from policy.candidate_families import Candidate, dominated_by_smaller
from policy.candidates import Candidates
from policy.catalog_index import CatalogIndex, MixedGrid, PromptLayout, ShapeTimes
from policy.decision_context import DecisionContext, LaneGroup, PromptGroup, RestoreGroup
from policy.descriptors import GraphKind, StateOp
from policy.prerequisites import PrerequisiteChoice, best_prerequisite
from policy.types import (
    DecodeMode,
    Lane,
    LaneRole,
    MixedRole,
    ScheduledPlan,
    ScheduledStep,
    SelectionReason,
)
from policy.utility import NS_PER_MS, BoolArray, IntArray, optimistic_rate
from policy.vision_prerequisites import ImageChoice, best_image_choice, vision_lanes

__all__ = [
    "BoolArray",
    "CatalogIndex",
    "DecisionContext",
    "IntArray",
    "LaneGroup",
    "MixedGrid",
    "PromptGroup",
    "PromptLayout",
    "RestoreGroup",
    "ShapeTimes",
    "select",
]

_dominated_by_smaller = dominated_by_smaller  # the name the dominance tests import


def select(ctx: DecisionContext) -> ScheduledPlan | None:
    """The winning plan of this decision, or None when nothing is runnable."""
    table = Candidates(ctx)
    pair = best_prerequisite(ctx)
    image = best_image_choice(ctx)
    if image is not None and (pair is None or image.key() < pair.key()):
        pair = None  # the better of the two prerequisite-like candidates competes
    else:
        image = None
    win = table.best() if table.families else None
    if win is None:
        return _restore_plan(ctx, pair) if pair is not None else _image_plan(ctx, image)
    other = pair if pair is not None else image
    if other is not None:
        # Prerequisites and held rows compete on the same footing: unknown first, then
        # value (PRE-2).
        pair_key = (0, other.value) if other.rate is None else (1, other.rate)
        win_key = (1, win.rate) if win.known else (0, win.base)
        if (-pair_key[0], pair_key[1]) > (-win_key[0], win_key[1]):
            return _restore_plan(ctx, pair) if pair is not None else _image_plan(ctx, image)
    reason = SelectionReason.ORDINARY if win.known else SelectionReason.DISCOVERY
    if ctx.refresh_funded and win.known:
        alternative = table.refresh(win.shape)
        if alternative is not None:
            win, reason = alternative, SelectionReason.TIMING_REFRESH
    return _build_plan(ctx, win, reason)


def _image_plan(ctx: DecisionContext, choice: ImageChoice | None) -> ScheduledPlan | None:
    """A held row's plan (``policy.vision_prerequisites``): a vision frame, or a chunk
    at a capacity holding the image at its cursor, built as an ordinary table row."""
    if choice is None:
        return None
    if choice.chunk is None:
        return _prerequisite_plan(ctx, choice.shape, vision_lanes(ctx, choice), choice.value,
                                  choice.rate, choice.following_shape)
    rate = choice.rate
    chunk = choice.chunk._replace(rate=0.0 if rate is None else rate, known=rate is not None)
    return _build_plan(ctx, chunk, SelectionReason.DISCOVERY if rate is None
                       else SelectionReason.ORDINARY)


def _restore_plan(ctx: DecisionContext, pair: PrerequisiteChoice) -> ScheduledPlan:
    """The prerequisite plan: only the prerequisite graph executes before replanning
    (PRE-19); its duration is its own (PRE-17). Terminal rows in its spare rows are
    TERMINAL lanes (PRE-4)."""
    shape = ctx.catalog.shapes[pair.shape]
    est = int(ctx.estimate_ns[pair.shape])
    group = ctx.restorable
    role = LaneRole.RESTORE if shape.state_op is StateOp.RESTORE else LaneRole.INITIALIZE
    t_ms = est / NS_PER_MS
    term = ctx.terminals
    lanes = tuple(
        [Lane(handle=group.records[i].handle, epoch=group.records[i].epoch, role=role)
         for i in pair.rows]
        + [Lane(handle=term.records[j].handle, epoch=term.records[j].epoch,
                role=LaneRole.TERMINAL, value=term.base_list[j] + term.slope * t_ms)
           for j in range(pair.terminals)])
    return _prerequisite_plan(ctx, pair.shape, lanes, pair.value, pair.rate,
                              pair.following_shape)


def _prerequisite_plan(ctx: DecisionContext, index: int, lanes: tuple[Lane, ...],
                       value: float, rate: float | None, following: int | None
                       ) -> ScheduledPlan:
    """A prerequisite's plan (restore, initialization or vision): its own duration, an
    empty window, the scored following shape kept as ``lookahead_shape`` only."""
    est = int(ctx.estimate_ns[index])
    known = est > 0
    return ScheduledPlan(
        step=ScheduledStep(shape=ctx.catalog.shapes[index], lanes=lanes),
        estimated_duration_ns=est,
        scaled_score=rate if rate is not None else optimistic_rate(value),
        scale_exponent=ctx.exponent,
        duration_known=known,
        stale=bool(ctx.stale[index]),
        reason=SelectionReason.ORDINARY if known else SelectionReason.DISCOVERY,
        requires_empty_window=True,
        planned_at_ns=ctx.now_ns,
        start_ns=ctx.start_ns,
        useful_value=value,
        lookahead_shape=None if following is None else ctx.catalog.shapes[following],
    )


def _build_plan(ctx: DecisionContext, win: Candidate, reason: SelectionReason
                ) -> ScheduledPlan:
    shape = ctx.catalog.shapes[win.shape]
    n_dec, n_term = win.n_dec, win.n_term
    prompt_pos, prompt_tokens = win.prompt_pos, win.prompt_tokens
    t_ms = float(win.est_ns) / NS_PER_MS
    lanes: list[Lane] = []
    if prompt_pos >= 0:
        p = ctx.prompts
        rec = p.records[prompt_pos]
        final = prompt_tokens == p.remaining[prompt_pos] and p.reaches[prompt_pos]
        value = prompt_tokens * p.price[prompt_pos] + (p.finish[prompt_pos] if final else 0.0)
        lanes.append(Lane(
            handle=rec.handle, epoch=rec.epoch, role=LaneRole.PROMPT,
            prompt_start=rec.prompt_cursor, prompt_tokens=prompt_tokens,
            token_ceiling=1 if final else 0, expected_tokens=1.0 if final else 0.0,
            expected_deliveries=1.0 if final else 0.0, value=value,
        ))
    # Lane values ``base[i] + slope * T``; Lanes are NamedTuples built positionally
    # (fields as in ``types.Lane``);
    # ``tuple.__new__`` skips the NamedTuple's Python-level constructor.
    dec = ctx.decoders
    new = tuple.__new__
    if n_dec:
        aged = dec.slope * t_ms
        decode = LaneRole.DECODE
        lanes.extend([new(Lane, (rec.handle, rec.epoch, decode, 0, 0, 1, 1.0, 1.0, b + aged))
                      for rec, b in zip(dec.records[:n_dec], dec.base_list, strict=False)])
    term = ctx.terminals
    if n_term:
        aged = term.slope * t_ms
        terminal = LaneRole.TERMINAL
        lanes.extend([new(Lane, (rec.handle, rec.epoch, terminal, 0, 0, 0, 0.0, 0.0,
                                 b + aged))
                      for rec, b in zip(term.records[:n_term], term.base_list, strict=False)])
    mixed = None
    if shape.kind is GraphKind.MIXED:
        mixed = MixedRole(prefill_row=0 if prompt_pos >= 0 else -1,
                          decode_mode=DecodeMode.ORDINARY)
    is_known = win.known
    stale = bool(ctx.stale[win.shape])
    useful = win.base
    return ScheduledPlan(
        step=ScheduledStep(shape=shape, lanes=tuple(lanes), mixed=mixed),
        estimated_duration_ns=win.est_ns,
        scaled_score=win.rate if is_known else optimistic_rate(useful),
        scale_exponent=ctx.exponent,
        duration_known=is_known,
        stale=stale,
        reason=reason,
        requires_empty_window=(not shape.is_generation) or (not is_known) or stale
        or reason is not SelectionReason.ORDINARY,
        planned_at_ns=ctx.now_ns,
        start_ns=ctx.start_ns,
        useful_value=useful,
    )
