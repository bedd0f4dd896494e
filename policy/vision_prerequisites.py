"""Vision programs as scheduled prerequisites, and prompt chunks that hold an image
whole (seed: *Prerequisites and completion*; PRE-1..29).

This module owns the *held* prompt rows of a decision: rows with image positions
whose next chunk the ordinary table (``policy/candidates.py``) must not plan, because

- its active window holds images not yet encoded and the catalog has vision
  programs: a vision program must encode them first (PRE-27), so the row is a
  prerequisite row, or
- an image starts at its cursor that the smallest prompt capacity could not hold
  whole, and a larger capacity can: only capacities holding the image may run the
  chunk (PRE-29), so an image is never split while a prepared capacity holds it.

A vision candidate is scored exactly as the restore pairs of ``prerequisites.py``:
each vision shape (duration T) is paired with every following prefill or mixed shape
(duration F) the row's chunk may run in; the following graph serves the newly ready
prompt row and, in a mixed shape, the highest-value ready decoders in its other rows
(PRE-5), their value aged to T + F (PRE-12); the sequence is scored over T + F with the
decoders' waiting cost (``sequence_rate``, PRE-11). A row whose due images exceed the
vision shape's capacity needs further vision stages: it is ranked by the continuation
index ``V*T/(T+F)`` with F the remaining vision executions plus its chunk (PRE-21..23).
Unknown durations rank by useful value (PRE-24). Spare image slots encode more due rows
at no extra cost (PRE-15). Feature storage bounds every vision frame: the images it
encodes, plus the row's own encoded images and those the ready prompt rows (windows
wholly encoded) still read, fit the storage (``window_images``), so scheduled vision
never evicts features a ready chunk needs; a frame that would is not offered, and
those chunks run first (a window always fits storage, so a frame is offered once
they have). The plan keeps the vision shape's own duration (PRE-17) and
only the vision frame executes before replanning (PRE-19); it earns no tokens
(PRE-20). Without vision programs in the catalog, image rows are not held for vision:
the prompt frame encodes its window's images itself (the fused path).

Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from policy.candidate_families import (
    MIXED_PROMPT,
    PREFILL,
    SCORED_PREFILL,
    Candidate,
    family_shapes,
    family_times,
)
from policy.prerequisites import continuation_index, multistage_rate, sequence_rate
from policy.requests import RequestRecord
from policy.types import Lane, LaneRole
from policy.utility import NS_PER_MS
from policy.vision_windows import head_image, stored_ahead

if TYPE_CHECKING:
    from policy.catalog_index import CatalogIndex
    from policy.decision_context import DecisionContext

__all__ = ["ImageChoice", "best_image_choice", "held_rows", "vision_lanes"]


class ImageChoice(NamedTuple):
    """The best held-row candidate of a decision.

    ``shape``: the catalog index of the graph to run (a vision shape, or the prompt
    shape of a chunk holding an image); ``following_shape``: the scored pair's
    following shape (None for a chunk or the continuation index); ``rows``: prompt
    positions (``ctx.prompts``) the vision shape encodes for, the scored one first;
    ``value``, ``rate`` (None: unknown duration) as in ``PrerequisiteChoice``;
    ``images``: how many images a vision frame encodes (0 for a chunk); ``chunk``: the
    ordinary-table row of a chunk candidate (None for vision)."""

    shape: int
    following_shape: int | None
    rows: tuple[int, ...]
    value: float
    rate: float | None
    basis: str
    images: int = 0
    chunk: Candidate | None = None

    def key(self) -> tuple[int, float, int]:
        """Smaller first: unknown durations first, then by value or rate, then more
        advanced work (PRE-16: images encoded, else rows), as ``PrerequisiteChoice.key``."""
        advanced = self.images or len(self.rows)
        if self.rate is None:
            return (0, -self.value, -advanced)
        return (1, -self.rate, -advanced)


def _largest_capacity(catalog: CatalogIndex, scored: bool) -> int:
    caps = family_shapes(catalog, SCORED_PREFILL if scored else PREFILL).caps
    if not scored:
        caps = caps + family_shapes(catalog, MIXED_PROMPT).caps
    return max(caps, default=0)


def _min_tokens(rec: RequestRecord, catalog: CatalogIndex) -> int:
    """The tokens a chunk from the cursor must consume to hold an image starting
    there whole; 0 when no image starts there or no prepared capacity holds it."""
    if rec.images is None:
        return 0
    head = head_image(rec.images, rec.prompt_cursor)
    return head if 0 < head <= _largest_capacity(catalog, rec.scored_prompt) else 0


def held_rows(prompts: Sequence[RequestRecord], catalog: CatalogIndex) -> list[int]:
    """The positions of ``prompts`` this module plans (see the module doc)."""
    vision = len(catalog.vision) > 0
    return [i for i, r in enumerate(prompts) if r.images is not None and (
        (vision and len(r.vision_due()) > 0) or _min_tokens(r, catalog) > 0)]


class _Column(NamedTuple):
    """One following shape for a held row: its catalog index, the ordinary-table row
    that runs it (value before decoder aging) and its decoders."""

    shape: int
    base: float
    est_ns: int
    n_dec: int
    candidate: Candidate


def _columns(ctx: DecisionContext, pos: int) -> list[_Column]:
    """The prefill (scored prefill for a scored row) and width-one mixed shapes the
    row's next chunk may run in: prompt capacity at least ``_min_tokens``, and per
    batch bucket only up to the first capacity reaching the logical end (a larger one
    repeats its work, SEL-32). A mixed shape also serves the highest-value decoders in
    its other rows (MIX-18..21)."""
    p, cat = ctx.prompts, ctx.catalog
    rec = p.records[pos]
    need = _min_tokens(rec, cat)
    rem, price, reaches, finish = p.remaining[pos], p.price[pos], p.reaches[pos], p.finish[pos]
    kinds = (SCORED_PREFILL,) if rec.scored_prompt else (PREFILL, MIXED_PROMPT)
    dec = ctx.decoders
    out: list[_Column] = []
    for kind in kinds:
        fam = family_shapes(cat, kind)
        est = family_times(ctx.times, kind, fam.shapes).est
        ended: set[int] = set()
        for j, (shape, batch, cap) in enumerate(zip(fam.shapes, fam.batch, fam.caps,
                                                    strict=True)):
            if cap < need or batch in ended:
                continue
            tokens = cap if cap < rem else rem
            if tokens == rem:
                ended.add(batch)
            value = tokens * price + (finish if tokens == rem and reaches else 0.0)
            n_dec = min(batch - 1, len(dec)) if kind == MIXED_PROMPT else 0
            cand = Candidate(kind, j, shape, value + dec.prefix_list[n_dec], 0.0, est[j] > 0,
                             est[j], n_dec + 1, rec.last_served_ns,
                             batch - n_dec - 1 if kind == MIXED_PROMPT else 0, cap - tokens,
                             pos, tokens, n_dec, 0)
            out.append(_Column(shape, cand.base, est[j], n_dec, cand))
    return out


def _chunk_choice(ctx: DecisionContext, pos: int) -> ImageChoice | None:
    """A held row with its images encoded (or no vision programs): its chunk at a
    capacity that holds the image at its cursor, ranked as the ordinary table ranks
    (value per time less the waiting cost; unknown by value)."""
    best: ImageChoice | None = None
    slope, w = ctx.decoders.slope, ctx.waiting
    for col in _columns(ctx, pos):
        ms = col.est_ns / NS_PER_MS
        if ms > 0:
            value = col.base + col.n_dec * slope * ms
            choice = ImageChoice(col.shape, None, (pos,), value, value / ms - ms / 2.0 * w,
                                 "chunk", chunk=col.candidate._replace(base=value))
        else:
            choice = ImageChoice(col.shape, None, (pos,), col.base, None, "chunk",
                                 chunk=col.candidate)
        if best is None or choice.key() < best.key():
            best = choice
    return best


def _fastest_vision_ms(ctx: DecisionContext, images: int) -> float:
    """The time to encode ``images`` more images: full executions of the largest vision
    shape, the rest in the fastest measured shape that holds it (unmeasured shapes
    count 0: unknown stages compare optimistically, PRE-24)."""
    shapes = ctx.catalog.vision.tolist()
    est = [int(ctx.estimate_ns[v]) / NS_PER_MS for v in shapes]
    slots = [int(ctx.catalog.batch[v]) for v in shapes]
    full, rest = divmod(images, slots[-1])
    tail = min((e for e, n in zip(est, slots, strict=True) if n >= rest and e > 0),
               default=0.0) if rest else 0.0
    return full * est[-1] + tail


def _vision_choices(ctx: DecisionContext, pos: int, due: int, spare: list[int],
                    room: int) -> list[ImageChoice]:
    """Every vision shape for a row with ``due`` images to encode: a pair with each
    following column when the shape holds them all, else the continuation index.
    ``room``: the images storage can take without evicting what resident rows read."""
    cols = _columns(ctx, pos)
    if not cols:
        return []
    slope, w = ctx.decoders.slope, ctx.waiting
    out = []
    for v in ctx.catalog.vision.tolist():
        t_ms = int(ctx.estimate_ns[v]) / NS_PER_MS
        slots = int(ctx.catalog.batch[v])
        if min(due, slots) > room:
            continue
        rows, images = _fill(ctx, pos, min(due, slots), min(slots, room), spare)
        for col in cols:
            f_ms = col.est_ns / NS_PER_MS
            value = col.base + col.n_dec * slope * (t_ms + f_ms)
            if due <= slots:
                rate = sequence_rate(value=value, first_ms=t_ms, following_ms=f_ms,
                                     waiting=w) if t_ms > 0 else None
                out.append(ImageChoice(v, col.shape, rows, value, rate, "pair", images))
                continue
            further = _fastest_vision_ms(ctx, due - slots) + f_ms
            contribution = continuation_index(value, t_ms, further) if t_ms > 0 else value
            rate = multistage_rate([contribution], t_ms, w) if t_ms > 0 else None
            out.append(ImageChoice(v, None, rows, contribution, rate, "multistage", images))
    return out


def _fill(ctx: DecisionContext, pos: int, used: int, slots: int, spare: list[int]
          ) -> tuple[tuple[int, ...], int]:
    """The scored row, then other due rows whose images fit the spare slots (PRE-15);
    and how many images they encode."""
    rows = [pos]
    for other in spare:
        if other == pos:
            continue
        n = len(ctx.prompts.records[other].vision_due())
        if used + n <= slots:
            rows.append(other)
            used += n
    return tuple(rows), used


def best_image_choice(ctx: DecisionContext) -> ImageChoice | None:
    """The best candidate over the held rows (None without any)."""
    p = ctx.prompts
    if not p.held:
        return None
    vision = len(ctx.catalog.vision) > 0
    due = {pos: len(p.records[pos].vision_due()) if vision else 0 for pos in p.held}
    spare = [pos for pos in p.held if due[pos]]
    kept = {i: stored_ahead(r.images, r.prompt_cursor, r.images_encoded)
            for i, r in enumerate(p.records) if r.images is not None} if spare else {}
    # What ready chunks read (rows whose windows are encoded); a due row's partly
    # encoded window may be evicted (it is encoded again), so rows never wait on each
    # other's partial windows.
    in_use = sum(n for i, n in kept.items() if not due.get(i))
    best: ImageChoice | None = None
    for pos in p.held:
        images = p.records[pos].images
        room = images.window_images - in_use - kept.get(pos, 0) if images is not None else 0
        options = (_vision_choices(ctx, pos, due[pos], spare, room) if due[pos]
                   else [_chunk_choice(ctx, pos)])
        for option in options:
            if option is not None and (best is None or option.key() < best.key()):
                best = option
    return best


def vision_lanes(ctx: DecisionContext, choice: ImageChoice) -> tuple[Lane, ...]:
    """The vision frame's lanes: one VISION lane per row, its ``prompt_start`` the row's
    first due image (it encodes ``vision_windows.vision_lane_images``). The plan
    (``selection``) keeps the vision program's own duration (PRE-17), needs an empty
    window, and only it executes before replanning (PRE-19)."""
    return tuple(Lane(handle=r.handle, epoch=r.epoch, role=LaneRole.VISION,
                      prompt_start=r.vision_due().start)
                 for r in (ctx.prompts.records[i] for i in choice.rows))
