"""Build one decision's inputs: projected prices and ages, sigma, scaled lane values.

This module owns the step between the scheduler's stored state and the selector:

- projection (QUEUE-33, QUEUE-41..43): each queued frame's frozen expected service is
  folded into *copies* of request histories over the frame's expected interval, with
  zero service for its other participants, and ages are taken at the queue's expected
  end; a request with a queued expected delivery ages from that delivery. Stored
  histories and ages are never touched (QUEUE-42, QUEUE-44..46);
- the reference intervals (SEL-15..17, MIX-23; same rule as ``utility.reference_interval_ms``): one for delivery-bearing streams over
  measured decode and mixed shapes, one for pending terminals over measured snapshot
  shapes (PRE-44); prefill-only requests never enlarge K;
- the shared scaling exponent (SEL-20) and every lane's scaled base value and age slope;
- the common waiting coefficient over all active decoders and pending terminals
  (SEL-19, PRE-45, SEL-8: prefill-only requests add none).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from policy.config import PolicyConfig
from policy.descriptors import StateOp
from policy.frame_queue import FrameQueue
from policy.requests import RequestRecord
from policy.selection import (
    CatalogIndex,
    DecisionContext,
    IntArray,
    LaneGroup,
    PromptGroup,
    RestoreGroup,
    ShapeTimes,
)
from policy.service import (
    ServiceHistory,
    delivery_price,
    observe_delivery,
    observe_service,
    output_token_price,
    prefill_token_price,
)
from policy.types import Phase, RequestHandle, RestoreNeed
from policy.utility import NS_PER_MS, scale_exponent, scaled

_RETIRED, _DECODE = Phase.RETIRED, Phase.DECODE
_TERMINAL, _PREFILL = Phase.TERMINAL, Phase.PREFILL
_NO_RESTORE, _AWAITING = RestoreNeed.NONE, RestoreNeed.AWAITING


def projected_histories(
    records: Mapping[RequestHandle, RequestRecord], queue: FrameQueue, config: PolicyConfig
) -> dict[RequestHandle, ServiceHistory]:
    """Copies of the histories touched by queued frames, advanced by each frame's
    frozen expected service (QUEUE-41, QUEUE-42)."""
    copies: dict[RequestHandle, ServiceHistory] = {}
    for frame in queue:
        interval_ms = frame.plan.estimated_duration_ns / NS_PER_MS
        if interval_ms <= 0:
            continue
        served = {lane.handle: lane for lane in frame.plan.lanes}
        for handle, epoch in frame.participants:
            rec = records.get(handle)
            if rec is None or rec.epoch != epoch:
                continue
            h = copies.get(handle)
            if h is None:
                h = copies[handle] = rec.history.copy()
            lane = served.get(handle)
            tokens = 0
            deliveries = 0
            if lane is not None:
                tokens = lane.prompt_tokens + round(lane.expected_tokens)
                deliveries = round(lane.expected_deliveries)
            observe_service(h, tokens=tokens, interval_ms=interval_ms, config=config)
            # A missing delivery history stays missing under zero deliveries (ACCT-19).
            observe_delivery(h, deliveries=deliveries, interval_ms=interval_ms, config=config)
    return copies


def family_reference_ms(catalog: CatalogIndex, times: ShapeTimes, family: IntArray,
                        streams: int) -> float | None:
    """``sigma = K*T/min(B, K)`` over the family's measured shapes (SEL-16); None when
    there is no stream or no measured shape (PRE-50)."""
    if streams <= 0 or len(family) == 0:
        return None
    est = times.estimate_ns[family]
    known = est > 0
    if not known.any():
        return None
    per_stream = (est / NS_PER_MS) / np.minimum(catalog.batch[family], streams)
    return streams * float(per_stream[known].min())


def _reference_ms(catalog: CatalogIndex, times: ShapeTimes, name: str, family: IntArray,
                  streams: int) -> float | None:
    """``family_reference_ms``, remembered until an estimate changes."""
    key = (name, streams)
    memo = times.sigma_memo
    if key in memo:
        return memo[key]
    sigma = memo[key] = family_reference_ms(catalog, times, family, streams)
    return sigma


def build_context(
    *,
    records: Mapping[RequestHandle, RequestRecord],
    catalog: CatalogIndex,
    times: ShapeTimes,
    config: PolicyConfig,
    queue: FrameQueue,
    now_ns: int,
    ttl_ns: int,
    refresh_funded: bool,
) -> DecisionContext:
    """Everything ``selection.select`` needs for a decision at the queue's expected end."""
    start_ns = queue.expected_end_ns(now_ns)
    histories = projected_histories(records, queue, config) if len(queue) else {}

    n_active = 0
    decoders: list[RequestRecord] = []
    terminals: list[RequestRecord] = []
    prompts: list[RequestRecord] = []
    restorable: list[RequestRecord] = []
    n_pending_terminals = 0
    # One pass with the ``selectable`` / ``restorable`` rules inlined (requests.py):
    # this loop runs over every resident request on every decision.
    for r in records.values():
        if r.cancelled:
            continue
        phase = r.phase
        if phase is _RETIRED:
            continue
        need = r.restore
        if need is _NO_RESTORE:
            if phase is _DECODE:
                n_active += 1
                if r.max_output_tokens - r.output_committed - r.queued_outputs > 0:
                    decoders.append(r)
            elif phase is _TERMINAL:
                n_pending_terminals += 1
                if not r.in_flight_fences:
                    terminals.append(r)
            elif phase is _PREFILL and not r.in_flight_fences:
                prompts.append(r)
        elif phase is _TERMINAL:
            n_pending_terminals += 1  # a preempted row is retired, never restored
        elif need is not _AWAITING:
            if not r.in_flight_fences:
                restorable.append(r)
            if phase is _DECODE:
                n_active += 1
    prompts.sort(key=lambda r: (r.last_served_ns, r.handle))  # DUR-24 order for ties

    n_dec, n_prompts = len(decoders), len(prompts)
    dec_hist = [histories.get(r.handle, r.history) for r in decoders] if histories \
        else [r.history for r in decoders]
    prompt_hist = [histories.get(r.handle, r.history) for r in prompts] if histories \
        else [r.history for r in prompts]
    # SEL-5..7 as arrays (service.py's scalar functions, the same IEEE operations):
    # f/x, output beta + f/x, prefill 1 + f/x, delivery g/z (a missing z priced at the
    # admission fair share).
    rates = np.array([h.token_rate for h in dec_hist] + [h.token_rate for h in prompt_hist]
                     + [h.fair_delivery_rate if h.delivery_rate is None else h.delivery_rate
                        for h in dec_hist]
                     + [h.fair_delivery_rate if h.delivery_rate is None else h.delivery_rate
                        for h in prompt_hist], dtype=np.float64)
    n_req = n_dec + n_prompts
    fair = config.token_fairness / rates[:n_req]
    delivery = config.delivery_fairness / rates[n_req:]
    output_price = config.output_token_value + fair
    prompt_token_price = 1.0 + fair[n_dec:]
    largest = float(np.abs(np.concatenate((output_price, delivery, prompt_token_price)))
                    .max(initial=0.0))
    e = scale_exponent((config.decode_age_price, config.terminal_value,
                        config.terminal_age_price, largest))

    sigma_dec = _reference_ms(catalog, times, "delivery", catalog.delivery_family, n_active)
    sigma_term = _reference_ms(catalog, times, "snapshot", catalog.snapshot,
                               n_pending_terminals)
    c_dec = scaled(config.decode_age_price, e)
    c_term = scaled(config.terminal_age_price, e)
    dec_slope = c_dec * sigma_dec if sigma_dec is not None else 0.0
    term_slope = c_term * sigma_term if sigma_term is not None else 0.0

    # output_age_ns (requests.py) for every decoder: from the later of the last visible
    # output and a queued expected delivery (QUEUE-43), never negative.
    ages_ms = np.array([max(start_ns - (r.last_visible_ns if r.queued_delivery_end_ns is None
                                        else max(r.last_visible_ns, r.queued_delivery_end_ns)),
                            0) for r in decoders], dtype=np.int64) / NS_PER_MS
    finish = output_price + delivery  # output token price + delivery price, per request
    dec_base = np.ldexp(finish[:n_dec], -e) + dec_slope * ages_ms
    term_value = scaled(config.terminal_value, e)
    term_base = [term_value + term_slope * (r.terminal_age_ns(start_ns) / NS_PER_MS)
                 for r in terminals]

    ints = np.array([(r.prompt_cursor, r.logical_prompt_end(), r.next_endpoint(),
                      r.prompt_len, r.last_served_ns) for r in prompts],
                    dtype=np.int64).reshape(n_prompts, 5)
    cursor, logical_end, endpoint, prompt_len = ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3]
    scored_rows = [i for i, r in enumerate(prompts) if r.scored_prompt]
    scored = np.zeros(n_prompts, dtype=np.bool_)
    if scored_rows:
        scored[scored_rows] = True
        ordinary_rows = np.flatnonzero(~scored)
    else:
        ordinary_rows = np.arange(n_prompts)
    prompt_group = PromptGroup(
        records=tuple(prompts),
        cursor=cursor,
        logical_remaining=logical_end - cursor,
        endpoint_remaining=endpoint - cursor,
        reaches_prompt_end=logical_end >= prompt_len,
        token_price=np.ldexp(prompt_token_price, -e),
        finish_value=np.ldexp(finish[n_dec:], -e),
        scored=scored,
        last_served=ints[:, 4],
        ordinary_rows=ordinary_rows,
        scored_rows=np.array(scored_rows, dtype=np.int64),
    )
    restore_group = _restore_group(restorable, catalog=catalog, times=times, config=config,
                                   e=e, start_ns=start_ns, dec_slope=dec_slope,
                                   c_dec=c_dec, sigma_dec=sigma_dec)
    return DecisionContext(
        catalog=catalog,
        times=times,
        estimate_ns=times.estimate_ns,
        stale=times.stale_at(now_ns, ttl_ns),
        last_touched_ns=times.last_touched_ns,
        decoders=LaneGroup.build(decoders, dec_base, dec_slope),
        terminals=LaneGroup.build(terminals, term_base, term_slope),
        prompts=prompt_group,
        restorable=restore_group,
        waiting=c_dec * n_active + c_term * n_pending_terminals,
        terminal_coefficient=c_term,
        exponent=e,
        now_ns=now_ns,
        start_ns=start_ns,
        refresh_funded=refresh_funded,
    )


def _fastest_ms(times: ShapeTimes, family: IntArray) -> float:
    """The fastest measured duration of a family (0 when none is measured: unknown
    stages count optimistically, PRE-24)."""
    est = times.estimate_ns[family]
    known = est[est > 0]
    return float(known.min()) / NS_PER_MS if len(known) else 0.0


def _first_chunk(times: ShapeTimes, catalog: CatalogIndex, token_price: float,
                 finish: float, remaining: int) -> tuple[float, float]:
    """A multistage prompt row's first chunk: the measured prefill shape with the best
    value per millisecond (the largest capacity when none is measured), as
    ``(value, duration_ms)``."""
    best: tuple[float, float] | None = None
    for i in catalog.prefill.tolist():
        cap = int(catalog.capacities[i, 1])
        value = token_price * min(cap, remaining) + (finish if cap >= remaining else 0.0)
        ms = float(times.estimate_ns[i]) / NS_PER_MS
        if ms > 0 and (best is None or value / ms > best[0] / best[1]):
            best = (value, ms)
    if best is None:
        return token_price * remaining + finish, 0.0
    return best


def _restore_group(restorable: list[RequestRecord], *, catalog: CatalogIndex,
                   times: ShapeTimes, config: PolicyConfig, e: int, start_ns: int,
                   dec_slope: float, c_dec: float, sigma_dec: float | None) -> RestoreGroup:
    """Prerequisite-ready rows with their values.

    A multistage row (further stages after the next one) is a blocked stream whose
    next delivery is at least its remaining chain away, so its age slope uses the
    individual future-delivery reference (SEL-18, OPEN-15)::

        sigma_i = sum of the fastest measured duration of every remaining stage
                  + the delivery family's reference interval sigma

    (no family reference: no age term, PRE-50). Single-stage rows keep the family
    sigma: the pair lookahead already scores their following inference exactly.
    """
    if not restorable:
        return RestoreGroup(records=(), decoding=(), base=(), slope=dec_slope,
                            token_price=(), finish_value=(), remaining=())
    stage_ms = {StateOp.RESTORE: _fastest_ms(times, catalog.restore),
                StateOp.INITIALIZE: _fastest_ms(times, catalog.initialize)}
    decode_ms = _fastest_ms(times, catalog.decode)
    decoding, base, slopes, further, cont = [], [], [], [], []
    token_price, finish_value, remaining = [], [], []
    for r in restorable:
        stages = r.remaining_stages
        chain_ms = sum(stage_ms.get(op, 0.0) for op in stages)
        after_next_ms = chain_ms - stage_ms.get(stages[0], 0.0)
        multistage = len(stages) > 1
        slope = dec_slope
        if multistage:
            slope = c_dec * (chain_ms + sigma_dec) if sigma_dec is not None else 0.0
        is_decoding = r.phase is Phase.DECODE
        price = scaled(prefill_token_price(r.history, config), e)
        finish = scaled(output_token_price(r.history, config)
                        + delivery_price(r.history, config), e)
        left = r.logical_prompt_end() - r.prompt_cursor if not is_decoding else 0
        finish_here = 0.0 if r.logical_prompt_end() < r.prompt_len else finish
        decoding.append(is_decoding)
        slopes.append(slope)
        token_price.append(price)
        finish_value.append(finish_here)
        remaining.append(left)
        if is_decoding:
            base.append(finish + slope * (r.output_age_ns(start_ns) / NS_PER_MS))
            further.append(after_next_ms + decode_ms)
            cont.append(0.0)
        else:
            base.append(0.0)
            value, chunk_ms = _first_chunk(times, catalog, price, finish_here, left)
            further.append(after_next_ms + chunk_ms)
            cont.append(value)
    return RestoreGroup(
        records=tuple(restorable), decoding=tuple(decoding), base=tuple(base),
        slope=dec_slope, token_price=tuple(token_price), finish_value=tuple(finish_value),
        remaining=tuple(remaining), next_op=tuple(r.next_stage for r in restorable),
        multistage=tuple(len(r.remaining_stages) > 1 for r in restorable),
        slopes=tuple(slopes), further_ms=tuple(further), continuation_value=tuple(cont),
    )
