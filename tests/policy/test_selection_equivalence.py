"""The fast selector equals the full-table reference on random catalogs and populations.

``selection.select`` ranks vectorised candidate families (``candidates.py``) and keeps
per-catalog and per-estimate structure between decisions; ``selection_reference`` is the
selector as first written, one materialised candidate table and one lexsort. Both must
return the same plan, bit for bit, for every decision context: random catalogs (mixed
shapes off the full grid, missing families, unmeasured shapes, durations that are not
monotone in capacity so dominated shapes can be faster), identical prompts (exact ties),
stale estimates with and without funded refresh, restorable rows and terminal
snapshots. Covers SEL-24, SEL-25, SEL-31..33, SEL-36..43, DUR-20..24, REF-7, REF-8,
MIX-18..21 by comparison with the specification; the prerequisite lookahead (PRE-2..16,
PRE-21..25, MIX-24, MIX-25) against ``prerequisites_reference`` the same way.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from decision_trace import serialise
from prerequisites_reference import best_prerequisite_reference
from selection_reference import select_reference

from policy import (
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GraphKind,
    GraphShape,
    Phase,
    RestoreNeed,
    Scheduler,
    StateOp,
)
from policy.config import PolicyConfig
from policy.decision import build_context
from policy.prerequisites import best_prerequisite
from policy.selection import select

MS = 1_000_000


def random_catalog(rng: random.Random) -> tuple[GraphShape, ...]:
    shapes: list[GraphShape] = []
    caps = (64, 128, 256, 512, 1024, 2048)
    batches = (1, 2, 4, 8, 16)
    if rng.random() < 0.9:
        shapes += [GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=c)
                   for c in caps if rng.random() < 0.6]
    if rng.random() < 0.4:
        shapes += [GraphShape(kind=GraphKind.SCORED_PREFILL, batch_capacity=1,
                              token_capacity=c) for c in caps if rng.random() < 0.5]
    if rng.random() < 0.9:
        shapes += [GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1,
                              packed_capacity=b) for b in batches if rng.random() < 0.6]
    full_grid = rng.random() < 0.5
    mixed_caps = [c for c in caps[:4] if rng.random() < 0.7]
    mixed_batches = [b for b in batches[1:] if rng.random() < 0.7]
    shapes += [GraphShape(kind=GraphKind.MIXED, batch_capacity=b, token_capacity=1,
                          prefill_capacity=c, packed_capacity=c + b - 1)
               for b in mixed_batches for c in mixed_caps if full_grid or rng.random() < 0.6]
    if rng.random() < 0.7:
        shapes += [GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                              state_op=StateOp.SNAPSHOT) for b in (1, 2, 4)
                   if rng.random() < 0.7]
    if rng.random() < 0.6:
        shapes += [GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                              state_op=StateOp.RESTORE) for b in (1, 2, 4, 8)
                   if rng.random() < 0.7]
    if rng.random() < 0.3:
        shapes += [GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                              state_op=StateOp.INITIALIZE) for b in (1, 2)
                   if rng.random() < 0.7]
    if shapes and not any(s.kind in (GraphKind.PREFILL, GraphKind.MIXED) for s in shapes):
        shapes.append(GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64))
    return tuple(shapes)


def random_duration_ns(shape: GraphShape, rng: random.Random) -> int:
    units = shape.token_capacity if shape.kind in (GraphKind.PREFILL,
                                                   GraphKind.SCORED_PREFILL) else 0
    units += shape.prefill_capacity + 8 * shape.batch_capacity
    # Not monotone in capacity: a larger (dominated) shape is sometimes the faster one.
    return max(1, round((1.0 + 0.02 * units * rng.uniform(0.3, 1.7)) * MS))


def check_run(seed: int, frames: int) -> int:
    """Drive one random run; compare both selectors on every decision context."""
    rng = random.Random(seed)
    catalog = random_catalog(rng)
    config = PolicyConfig(estimate_ttl_ns=rng.choice((40, 400, 30_000)) * MS)
    s = Scheduler(config=config, catalog=catalog)
    durations = {shape: random_duration_ns(shape, rng) for shape in catalog}
    for shape in catalog:
        if rng.random() < 0.75:
            s.estimates.observe(shape, durations[shape], 1)
    s.advance_to(2)
    position = {shape: i for i, shape in enumerate(catalog)}
    same_prompt = rng.randint(16, 900)
    restore_rate = rng.choice((0.05, 0.3))
    compared = 0
    fence = 0
    for _ in range(frames):
        while len(s.handles()) < 10:
            twin = rng.random() < 0.4  # identical requests: exact value ties
            prompt = same_prompt if twin else rng.randint(16, 1500)
            blocked = not twin and rng.random() < restore_rate
            s.admit(prompt_len=prompt, max_output_tokens=4 if twin else rng.randint(1, 12),
                    message_ends=() if twin else (rng.randint(1, prompt),),
                    system_end=None if twin or rng.random() < 0.8 else rng.randint(1, prompt),
                    scored_prompt=not twin and rng.random() < 0.2,
                    restore=RestoreNeed.READY if blocked else RestoreNeed.NONE,
                    further_stages=(StateOp.INITIALIZE,) if blocked and rng.random() < 0.3
                    else ())
            rec = s.request(s.handles()[-1])
            if rec.restore is RestoreNeed.READY and rng.random() < 0.5:
                # A blocked decoder: its prompt is done, its state awaits a restore graph.
                rec.phase, rec.prompt_cursor = Phase.DECODE, rec.prompt_len
                rec.last_visible_ns = s.now_ns - rng.randint(0, 50) * MS
        ctx = build_context(records={h: s.request(h) for h in s.handles()},
                            catalog=s._catalog, times=s._shape_times(), config=s.config,
                            queue=s._queue, now_ns=s.now_ns, ttl_ns=s.estimates.ttl_ns,
                            refresh_funded=False)
        for funded in (False, True):
            c = dataclasses.replace(ctx, refresh_funded=funded)
            assert serialise(select(c), position) == serialise(select_reference(c), position)
            compared += 1
        assert repr(best_prerequisite(ctx)) == repr(best_prerequisite_reference(ctx))
        plan = s.plan()
        if plan is None:
            s.advance_to(s.now_ns + MS)
            continue
        fence += 1
        s.commit(plan, Fence(fence))
        d = durations[plan.shape]
        s.advance_to(s.now_ns + d)
        s.complete(Fence(fence), [CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                                   prompt_tokens=lane.prompt_tokens,
                                                   token_ids=(1,) * lane.token_ceiling)
                                  for lane in plan.lanes],
                   ExecutionTiming(device_intervals_ns=(d,), wall_ns=d))
        s.take_released()
    return compared


@pytest.mark.parametrize("block", range(4))
def test_sel_fast_selection_equals_the_full_table_reference(block: int) -> None:
    """Covers SEL-24/25/31..33/36..43, DUR-20..24, REF-7/8, MIX-18..21: 40 random
    catalogs x 25 decisions (each with and without funded refresh) decide identically."""
    compared = sum(check_run(seed, frames=25) for seed in range(block * 10, block * 10 + 10))
    assert compared == 10 * 25 * 2
