"""The prepared shapes a baseline may use, grouped and sorted, and the step builders.

This module owns ``ShapeMenu``: the catalog seen the way a conventional scheduler sees
it (decode batch buckets, prefill chunk capacities, ordinary width-one mixed programs by
batch bucket, host-allocated speculative programs by width, snapshot programs) plus the
pure helpers that turn "these requests, this
many prompt tokens" into a ``ScheduledStep`` on the smallest prepared shape that holds
it. Baselines never invent a shape: every step they plan runs a prepared program
(seed: *Mixed execution contract*, padding rows earn nothing, MIX-21).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from policy.descriptors import GraphKind, GraphShape, StateOp, TargetBinding
from policy.types import (
    DecodeMode,
    Lane,
    LaneRole,
    MixedRole,
    PolicyError,
    RequestHandle,
    ScheduledStep,
)


@dataclass(frozen=True, slots=True)
class PromptWork:
    """One prompt chunk to plan: whose, from where, how many tokens, and whether it
    reaches the prompt end (so the lane commits the first output token)."""

    handle: RequestHandle
    epoch: int
    start: int
    tokens: int
    final: bool


@dataclass(frozen=True, slots=True)
class ShapeMenu:
    """Sorted views of one catalog (every field may be empty)."""

    shapes: tuple[GraphShape, ...]
    decode: tuple[GraphShape, ...]
    """Ordinary decode programs by batch capacity."""
    prefill: tuple[GraphShape, ...]
    """Ordinary prefill programs by chunk capacity."""
    mixed: dict[int, tuple[GraphShape, ...]]
    """Width-one, non-speculative mixed programs: batch capacity -> by prompt capacity."""
    snapshot: tuple[GraphShape, ...]
    speculative: tuple[GraphShape, ...] = ()
    """Host-allocated (``QueryLength``) speculative programs by width, batch, packed
    capacity. Device-allocated ones are left out: a fixed proposal depth is a host choice
    (SPEC-19)."""

    @staticmethod
    def build(shapes: Iterable[GraphShape]) -> ShapeMenu:
        unique = tuple(dict.fromkeys(shapes))
        mixed: dict[int, list[GraphShape]] = {}
        for s in unique:
            if s.kind is GraphKind.MIXED and s.token_capacity == 1 and not s.speculation_enabled:
                mixed.setdefault(s.batch_capacity, []).append(s)
        return ShapeMenu(
            shapes=unique,
            decode=tuple(sorted((s for s in unique if s.kind is GraphKind.DECODE),
                                key=lambda s: s.batch_capacity)),
            prefill=tuple(sorted((s for s in unique if s.kind is GraphKind.PREFILL),
                                 key=lambda s: s.token_capacity)),
            mixed={b: tuple(sorted(v, key=lambda s: s.prefill_capacity))
                   for b, v in sorted(mixed.items())},
            snapshot=tuple(sorted(
                (s for s in unique
                 if s.kind is GraphKind.STATE and s.state_op is StateOp.SNAPSHOT),
                key=lambda s: s.batch_capacity)),
            speculative=tuple(sorted(
                (s for s in unique if s.kind is GraphKind.SPECULATIVE
                 and s.binding is TargetBinding.QUERY_LENGTH),
                key=lambda s: (s.token_capacity, s.batch_capacity, s.packed_capacity))),
        )

    def check_usable(self, *, rounds: bool = False) -> None:
        """A baseline needs at least one prefill and one decode program (``rounds``: a
        speculative program may stand in for decode)."""
        generation = self.decode or (rounds and self.speculative)
        if self.shapes and (not self.prefill or not generation):
            raise PolicyError("baseline policies need prefill and decode programs in the catalog")

    def round_shapes(self, rows: int) -> tuple[GraphShape, ...]:
        """The speculative programs a round of ``rows`` target rows per lane runs on:
        those of the narrowest width ``W >= rows`` whose proposal depth reaches
        ``rows - 1``, by batch and packed capacity (empty when none)."""
        fit = [s for s in self.speculative
               if s.token_capacity >= rows and s.proposal_depth >= rows - 1]
        if not fit:
            return ()
        width = fit[0].token_capacity
        return tuple(s for s in fit if s.token_capacity == width)

    @property
    def max_decode_batch(self) -> int:
        return self.decode[-1].batch_capacity if self.decode else 0

    @property
    def max_prefill(self) -> int:
        return self.prefill[-1].token_capacity if self.prefill else 0

    @property
    def has_mixed(self) -> bool:
        return bool(self.mixed)

    def prefill_capacities(self) -> list[int]:
        return [s.token_capacity for s in self.prefill]

    # ---- step builders ---------------------------------------------------------------

    def decode_step(self, decoders: Sequence[tuple[RequestHandle, int]]) -> ScheduledStep:
        """Decode the first ``max_decode_batch`` of ``decoders`` on the smallest bucket."""
        lanes = decoders[: self.max_decode_batch]
        shape = _smallest(self.decode, len(lanes), lambda s: s.batch_capacity)
        return ScheduledStep(shape=shape, lanes=tuple(
            _decode_lane(h, e) for h, e in lanes))

    def prefill_step(self, work: PromptWork) -> ScheduledStep:
        """One prompt chunk on the smallest prefill capacity that holds it."""
        shape = _smallest(self.prefill, work.tokens, lambda s: s.token_capacity)
        return ScheduledStep(shape=shape, lanes=(_prompt_lane(work),))

    def snapshot_step(self, terminals: Sequence[tuple[RequestHandle, int]]) -> ScheduledStep:
        """Terminal snapshots for the first rows that fit the largest snapshot program."""
        lanes = terminals[: self.snapshot[-1].batch_capacity]
        shape = _smallest(self.snapshot, len(lanes), lambda s: s.batch_capacity)
        return ScheduledStep(shape=shape, lanes=tuple(
            Lane(handle=h, epoch=e, role=LaneRole.TERMINAL) for h, e in lanes))

    def round_step(self, shapes: Sequence[GraphShape],
                   lanes: Sequence[tuple[RequestHandle, int, int]]) -> ScheduledStep:
        """A complete speculative round: ``(handle, epoch, rows)`` lanes, each with a
        host length of ``rows`` target rows (SPEC-19), on the smallest of ``shapes``
        (``round_shapes``) holding them in both request rows and packed rows."""
        total = sum(rows for _, _, rows in lanes)
        for shape in shapes:
            if shape.batch_capacity >= len(lanes) and shape.max_packed_extent >= total:
                return ScheduledStep(shape=shape, lanes=tuple(
                    Lane(handle=h, epoch=e, role=LaneRole.DECODE, token_ceiling=rows,
                         expected_tokens=1.0, expected_deliveries=1.0)
                    for h, e, rows in lanes))
        raise PolicyError(f"no prepared speculative program holds {len(lanes)} lanes "
                          f"and {total} rows")

    def mixed_batch_for(self, rows: int) -> int | None:
        """The smallest mixed batch bucket with at least ``rows`` rows."""
        for b in self.mixed:
            if b >= rows:
                return b
        return None

    def mixed_step(self, batch: int, work: PromptWork,
                   decoders: Sequence[tuple[RequestHandle, int]]) -> ScheduledStep:
        """A prompt row (dense row 0) plus decoders on mixed bucket ``batch``."""
        if len(decoders) + 1 > batch:
            raise PolicyError("mixed step has more rows than its batch bucket")
        shape = _smallest(self.mixed[batch], work.tokens, lambda s: s.prefill_capacity)
        lanes = (_prompt_lane(work), *(_decode_lane(h, e) for h, e in decoders))
        return ScheduledStep(shape=shape, lanes=lanes,
                             mixed=MixedRole(prefill_row=0, decode_mode=DecodeMode.ORDINARY))


def largest_at_most(capacities: Sequence[int], limit: int) -> int:
    """The largest of sorted ``capacities`` not above ``limit`` (0 if none)."""
    i = bisect.bisect_right(capacities, limit)
    return capacities[i - 1] if i else 0


def _smallest(shapes: Sequence[GraphShape], need: int,
              size: Callable[[GraphShape], int]) -> GraphShape:
    for s in shapes:
        if size(s) >= need:
            return s
    raise PolicyError(f"no prepared shape holds {need}")


def _decode_lane(handle: RequestHandle, epoch: int) -> Lane:
    return Lane(handle=handle, epoch=epoch, role=LaneRole.DECODE, token_ceiling=1,
                expected_tokens=1.0, expected_deliveries=1.0)


def _prompt_lane(work: PromptWork) -> Lane:
    return Lane(handle=work.handle, epoch=work.epoch, role=LaneRole.PROMPT,
                prompt_start=work.start, prompt_tokens=work.tokens,
                token_ceiling=1 if work.final else 0,
                expected_tokens=1.0 if work.final else 0.0,
                expected_deliveries=1.0 if work.final else 0.0)
