"""Prerequisite lookahead through the production scheduler: terminal rows in a restore
graph's spare rows (PRE-4), the productive first-stage prefix (PRE-14), mixed following
shapes (MIX-24, MIX-25) against brute force, and multistage chains with the
continuation index and the individual future-delivery reference (PRE-21, PRE-22, PRE-23, PRE-24, PRE-25, SEL-18,
OPEN-15)."""

from __future__ import annotations

import itertools
import random

import pytest
from selection_setup import make_decoder, make_prompt
from synthetic_catalog import (
    MS,
    decode,
    duration_ns,
    measured_scheduler,
    mixed,
    records_for,
    snapshot,
)

from policy import (
    ExecutionTiming,
    Fence,
    GraphKind,
    GraphShape,
    LaneRole,
    Phase,
    RequestHandle,
    RestoreNeed,
    Scheduler,
    StateOp,
)
from policy.decision import build_context
from policy.prerequisites import best_prerequisite
from policy.selection import DecisionContext
from policy.service import delivery_price, output_token_price
from policy.utility import scaled


def restore(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                      state_op=StateOp.RESTORE)


def initialize(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.STATE, batch_capacity=b, token_capacity=1,
                      state_op=StateOp.INITIALIZE)


def context(s: Scheduler) -> DecisionContext:
    return build_context(records={h: s.request(h) for h in s.handles()}, catalog=s._catalog,
                         times=s._shape_times(), config=s.config, queue=s._queue,
                         now_ns=s.now_ns, ttl_ns=s.estimates.ttl_ns, refresh_funded=False)


def terminal(s: Scheduler, age_ms: float) -> RequestHandle:
    h = make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=0.0)
    rec = s.request(h)
    rec.phase = Phase.TERMINAL
    rec.terminal_since_ns = s.now_ns - round(age_ms * MS)
    return h


def blocked_decoder(s: Scheduler, *, age_ms: float = 20.0, token_rate: float = 1.0,
                    further: tuple[StateOp, ...] = ()) -> RequestHandle:
    h = make_decoder(s, token_rate=token_rate, delivery_rate=1.0, age_ms=age_ms)
    s.request(h).restore = RestoreNeed.READY
    s.request(h).further_stages = further
    return h


def run(s: Scheduler, fence: int) -> None:
    plan = s.plan()
    assert plan is not None
    s.commit(plan, Fence(fence))
    d = s.estimates.estimate_ns(plan.shape) or MS
    s.advance_to(s.now_ns + d)
    s.complete(Fence(fence), records_for(plan), ExecutionTiming(device_intervals_ns=(d,),
                                                                wall_ns=d))


# ---- PRE-4 / PRE-14 through the scheduler ---------------------------------------------

def test_pre_4_terminal_rows_finish_in_spare_restore_rows() -> None:
    """Covers PRE-4, PRE-7, PRE-15: a restore graph with room for four rows restores the
    blocked decoder and snapshots the two pending terminals in its spare rows; the
    terminals retire when it completes and the restored request decodes next."""
    cat = {decode(1): duration_ns(decode(1)), decode(2): duration_ns(decode(2)),
           snapshot(1): 40 * MS, restore(4): MS}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    blocked = blocked_decoder(s)
    done = {terminal(s, 5.0), terminal(s, 1.0)}
    plan = s.plan()
    assert plan is not None and plan.shape == restore(4)
    roles = {lane.handle: lane.role for lane in plan.lanes}
    assert roles == {blocked: LaneRole.RESTORE, **{h: LaneRole.TERMINAL for h in done}}
    assert plan.estimated_duration_ns == MS  # PRE-17
    s.commit(plan, Fence(1))
    s.advance_to(s.now_ns + MS)
    assert s.complete(Fence(1), records_for(plan),
                      ExecutionTiming(device_intervals_ns=(MS,), wall_ns=MS)) == []
    assert set(s.take_released()) == done
    following = s.plan()
    assert following is not None and following.handles() == (blocked,)
    assert following.shape.kind is GraphKind.DECODE


def test_pre_4_initialize_graph_carries_no_terminal_rows() -> None:
    """Covers PRE-4's limit: an initialization graph copies no rows, so terminal rows
    never ride in it."""
    cat = {decode(1): duration_ns(decode(1)), initialize(4): MS, restore(1): MS}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    h = blocked_decoder(s, further=(StateOp.INITIALIZE,))
    s.request(h).restored = True  # the restore already ran: initialization is next
    terminal(s, 1.0)
    plan = s.plan()
    assert plan is not None and plan.shape == initialize(4)
    assert [lane.role for lane in plan.lanes] == [LaneRole.INITIALIZE]


def test_pre_14_first_stage_prefix_is_scored_on_its_own() -> None:
    """Covers PRE-14, PRE-13: when the following inference is very slow the complete
    sequence scores poorly, yet a restore graph finishing three terminal rows in 1.2 ms
    is worth more than the one-row snapshot: the prefix is compared too. Without the
    prefix the one-row snapshot would win."""
    cat = {decode(1): 1_000 * MS, snapshot(1): MS, restore(4): round(1.2 * MS)}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    blocked_decoder(s, age_ms=0.0)
    terms = {terminal(s, 2.0) for _ in range(3)}
    ctx = context(s)
    choice = best_prerequisite(ctx)
    assert choice is not None and choice.basis == "prefix" and choice.terminals == 3
    t_ms = 1.2
    expected = (float(ctx.terminals.prefix[3]) + 3 * ctx.terminals.slope * t_ms) / t_ms \
        - t_ms / 2 * ctx.waiting
    assert choice.rate == pytest.approx(expected, rel=1e-12)
    plan = s.plan()
    assert plan is not None and plan.shape == restore(4)
    assert {lane.handle for lane in plan.lanes if lane.role is LaneRole.TERMINAL} == terms
    assert plan.lookahead_shape is None


# ---- MIX-24 / MIX-25: mixed following shapes, brute force ------------------------------

RESTORES = (restore(1), restore(2), restore(4))
MIXED = (mixed(2, 64), mixed(4, 64), mixed(2, 256))


def brute_force_rate(ctx: DecisionContext) -> float:
    """Every legal (prerequisite, following, cohort) combination, enumerated, scored by
    the seed's two-stage rule written out directly (PRE-11, PRE-12, PRE-13, PRE-14, PRE-46, MIX-25)."""
    cat, group = ctx.catalog, ctx.restorable
    new_dec = [i for i, d in enumerate(group.decoding) if d]
    new_prompt = [i for i, d in enumerate(group.decoding) if not d]
    dec, term, p = ctx.decoders, ctx.terminals, ctx.prompts
    ready_prompts = [j for j in range(len(p.records)) if not p.scored[j]]

    def prompt_value(price: float, finish: float, remaining: int, cap: int) -> float:
        return price * min(cap, remaining) + (finish if cap >= remaining else 0.0)

    best = -float("inf")
    c_t = ctx.terminal_coefficient
    for r in cat.restore.tolist():
        t = ctx.estimate_ns[r] / MS
        b_r = int(cat.batch[r])
        # The first-stage prefix: at least one newly ready row, terminals in the rest.
        for n_t in range(0, min(b_r - 1, len(term)) + 1):
            for chosen in itertools.combinations(range(len(term)), n_t):
                if n_t:
                    v = sum(float(term.base[j]) + term.slope * t for j in chosen)
                    best = max(best, v / t - t / 2 * ctx.waiting)
        for s in [*cat.mixed.tolist(), *cat.decode.tolist(), *cat.prefill.tolist()]:
            shape = cat.shapes[s]
            f = ctx.estimate_ns[s] / MS
            span = t + f
            b_s = shape.batch_capacity
            kind = shape.kind
            cap = shape.prefill_capacity if kind is GraphKind.MIXED else shape.token_capacity
            prompt_options: list[tuple[str, int]] = [("none", -1)]
            if kind is not GraphKind.DECODE:
                prompt_options += [("new", i) for i in new_prompt]
            if kind is GraphKind.MIXED:
                prompt_options += [("ready", j) for j in ready_prompts]
            for which, pi in prompt_options:
                if kind is GraphKind.PREFILL and which != "new":
                    continue
                prompt_rows = 0 if which == "none" else 1
                pv = 0.0
                if which == "new":
                    pv = prompt_value(group.token_price[pi], group.finish_value[pi],
                                      group.remaining[pi], cap)
                elif which == "ready":
                    pv = prompt_value(float(p.token_price[pi]), float(p.finish_value[pi]),
                                      int(p.logical_remaining[pi]), cap)
                dec_room = 0 if kind is GraphKind.PREFILL else b_s - prompt_rows
                for nk in range(len(new_dec) + 1):
                    for nd in itertools.combinations(new_dec, nk):
                        if nk + (which == "new") < 1:
                            continue  # PRE-10
                        for rk in range(len(dec) + 1):
                            if nk + rk > dec_room:
                                break
                            for rd in itertools.combinations(range(len(dec)), rk):
                                for tk in range(len(term) + 1):
                                    if nk + (which == "new") + tk > b_r:
                                        break
                                    for td in itertools.combinations(range(len(term)), tk):
                                        v = pv + sum(group.base[i] + group.slope * span
                                                     for i in nd)
                                        v += sum(float(dec.base[j]) + dec.slope * span
                                                 for j in rd)
                                        v += sum(float(term.base[j]) + term.slope * t
                                                 for j in td)
                                        rate = v / span - span / 2 * (ctx.waiting - c_t * tk) \
                                            - c_t * tk * t * t / 2 / span
                                        best = max(best, rate)
    return best


@pytest.mark.parametrize("case", ["absent", "ready", "enabled"])
@pytest.mark.parametrize("seed", range(12))
def test_mix_24_25_mixed_following_pairs_match_brute_force(case: str, seed: int) -> None:
    """Covers MIX-24, MIX-25, PRE-7, PRE-9, PRE-13, PRE-14, PRE-46: with mixed following
    shapes and the prompt absent, already ready, or enabled by the restore, the
    scheduler's pair score equals exhaustive enumeration of every legal cohort."""
    rng = random.Random(seed * 7 + len(case))
    cat: dict[GraphShape, int] = {sh: round(rng.uniform(0.5, 4.0) * MS) for sh in RESTORES}
    cat |= {sh: duration_ns(sh) for sh in MIXED}
    cat[snapshot(1)] = 2 * MS
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    for _ in range(rng.randint(1, 3)):
        blocked_decoder(s, age_ms=rng.uniform(0, 40), token_rate=rng.uniform(0.2, 4))
    for _ in range(rng.randint(0, 2)):
        make_decoder(s, token_rate=rng.uniform(0.2, 4), delivery_rate=rng.uniform(0.2, 2),
                     age_ms=rng.uniform(0, 40))
    for _ in range(rng.randint(0, 2)):
        terminal(s, rng.uniform(0, 30))
    if case == "ready":
        for _ in range(rng.randint(1, 2)):
            make_prompt(s, prompt_len=rng.choice([40, 100, 300]), token_rate=rng.uniform(0.2, 4))
    if case == "enabled":
        for _ in range(rng.randint(1, 2)):
            h = make_prompt(s, prompt_len=rng.choice([40, 100, 300]),
                            token_rate=rng.uniform(0.2, 4))
            s.request(h).restore = RestoreNeed.READY
    ctx = context(s)
    choice = best_prerequisite(ctx)
    assert choice is not None and choice.rate is not None
    assert choice.rate == pytest.approx(brute_force_rate(ctx), rel=1e-9, abs=1e-12)
    if choice.basis == "pair":
        assert choice.following_shape is not None
        assert ctx.catalog.shapes[choice.following_shape] in MIXED  # MIX-24


def test_mix_25_enabled_prompt_plan_restores_the_prompt_row() -> None:
    """Covers MIX-25 (prompt enabled by the prerequisite), PRE-5: a restored prompt and a
    restored decoder are scored with a following mixed step serving both."""
    cat = {restore(2): MS, mixed(2, 64): duration_ns(mixed(2, 64))}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    dec = blocked_decoder(s)
    prompt = make_prompt(s, prompt_len=40, token_rate=1.0)
    s.request(prompt).restore = RestoreNeed.READY
    plan = s.plan()
    assert plan is not None and plan.shape == restore(2)
    assert set(plan.handles()) == {dec, prompt} and plan.lookahead_shape == mixed(2, 64)


# ---- multistage chains: PRE-21, PRE-22, PRE-23, PRE-24, PRE-25, SEL-18, OPEN-15 -------------------------------------

def chain_scheduler(init_ms: float | None = 2.0) -> tuple[Scheduler, dict[GraphShape, int]]:
    cat = {restore(1): MS, initialize(1): round((init_ms or 0) * MS),
           decode(1): duration_ns(decode(1))}
    s = Scheduler(catalog=tuple(cat))
    for shape, d in cat.items():
        if d:
            s.estimates.observe(shape, d, 1)
    s.advance_to(1)
    return s, cat


def test_pre_21_22_sel_18_multistage_row_uses_continuation_index() -> None:
    """Covers PRE-21, PRE-22, PRE-23, PRE-25, SEL-18, OPEN-15: a decoder behind a restore
    and an initialization is ranked by V*T/(T+F), with F the initialization plus its
    first decode, and its age slope uses its individual future-delivery reference
    sigma_i = restore + initialization + family sigma (not the family sigma)."""
    s, cat = chain_scheduler()
    h = blocked_decoder(s, age_ms=30.0, further=(StateOp.INITIALIZE,))
    ctx = context(s)
    e = ctx.exponent
    rec = s.request(h)
    price = output_token_price(rec.history, s.config) + delivery_price(rec.history, s.config)
    t, init, dec_ms = 1.0, 2.0, cat[decode(1)] / MS
    family_sigma = dec_ms  # K = 1, decode(1): sigma = T
    sigma_i = t + init + family_sigma
    slope = scaled(s.config.decode_age_price, e) * sigma_i
    assert ctx.restorable.slopes[0] == pytest.approx(slope, rel=1e-12)
    assert ctx.restorable.slopes[0] != pytest.approx(ctx.restorable.slope)
    f = init + dec_ms
    v = scaled(price, e) + slope * (30.0 + t + f)
    choice = best_prerequisite(ctx)
    assert choice is not None and choice.basis == "multistage"
    assert choice.rate == pytest.approx(v * t / (t + f) / t - t / 2 * ctx.waiting, rel=1e-9)


def test_pre_24_unknown_later_stage_counts_optimistically() -> None:
    """Covers PRE-24: an unmeasured initialization graph adds nothing to F."""
    s, cat = chain_scheduler(init_ms=None)
    blocked_decoder(s, further=(StateOp.INITIALIZE,))
    ctx = context(s)
    assert ctx.restorable.further_ms[0] == pytest.approx(cat[decode(1)] / MS)


def test_pre_19_32_multistage_chain_runs_stage_by_stage_through_the_scheduler() -> None:
    """Covers PRE-19, PRE-20, PRE-32, PRE-25: restore (fresh epoch), then the
    initialization graph, then the request decodes; each stage is planned on its own."""
    s, _ = chain_scheduler()
    h = s.admit(prompt_len=8, max_output_tokens=4, restore=RestoreNeed.READY,
                further_stages=(StateOp.INITIALIZE,))
    rec = s.request(h)
    rec.phase, rec.prompt_cursor, rec.output_committed = Phase.DECODE, 8, 1
    epoch = rec.epoch
    first = s.plan()
    assert first is not None and first.shape == restore(1)
    run(s, 1)
    assert s.request(h).epoch == epoch + 1 and s.request(h).restore is RestoreNeed.READY
    second = s.plan()
    assert second is not None and second.shape == initialize(1)
    assert [lane.role for lane in second.lanes] == [LaneRole.INITIALIZE]
    run(s, 2)
    assert s.request(h).restore is RestoreNeed.NONE and s.request(h).epoch == epoch + 1
    third = s.plan()
    assert third is not None and third.shape == decode(1) and third.handles() == (h,)


def test_admission_refuses_stages_without_restore() -> None:
    s, _ = chain_scheduler()
    from policy import AdmissionRefused
    with pytest.raises(AdmissionRefused):
        s.admit(prompt_len=8, max_output_tokens=4, further_stages=(StateOp.INITIALIZE,))
    with pytest.raises(AdmissionRefused):
        s.admit(prompt_len=8, max_output_tokens=4, restore=RestoreNeed.READY,
                further_stages=(StateOp.SNAPSHOT,))


def test_pre_43_preempted_restorable_request_is_not_restored() -> None:
    """Covers PRE-43, PRE-39: preempting a request whose state was never restored
    retires it at once (nothing resident to snapshot, so it is released); one that was
    restored but still waits for a later stage gets a terminal snapshot instead."""
    cat = {decode(1): duration_ns(decode(1)), restore(1): MS, snapshot(1): MS}
    s = measured_scheduler(tuple(cat), durations=cat.__getitem__)
    h = blocked_decoder(s)
    s.preempt(h)
    assert s.phase(h) is Phase.RETIRED and s.take_released() == [h]
    assert s.plan() is None
    h2 = blocked_decoder(s, further=(StateOp.INITIALIZE,))
    s.request(h2).restored = True
    s.preempt(h2)
    assert s.phase(h2) is Phase.TERMINAL
    plan = s.plan()
    assert plan is not None and plan.shape == snapshot(1) and plan.handles() == (h2,)
