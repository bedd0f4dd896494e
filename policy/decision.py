"""Build one decision's inputs: projected prices and ages, sigma, scaled lane values.

This module owns the step between the scheduler's stored state and the selector:

- projection (QUEUE-33, QUEUE-41..43): each queued frame's frozen expected service is
  folded into *copies* of request histories over the frame's expected interval, with
  zero service for its other participants, and ages are taken at the queue's expected
  end; a request with a queued expected delivery ages from that delivery. Stored
  histories and ages are never touched (QUEUE-42, QUEUE-44..46);
- the reference intervals (SEL-15..17, MIX-23; same rule as
  ``utility.reference_interval_ms``): one for delivery-bearing streams over measured
  decode and mixed shapes, one for pending terminals over measured snapshot shapes
  (PRE-44); prefill-only requests never enlarge K;
- the shared scaling exponent (SEL-20) and every lane's scaled base value and age slope;
- the common waiting coefficient over all active decoders and pending terminals
  (SEL-19, PRE-45, SEL-8: prefill-only requests add none).

It runs on every decision, so it reads each resident record once and computes the
per-request prices as Python floats (the same IEEE operations as ``service.py``'s
scalar price functions; a few dozen requests are too few for numpy calls to pay);
values derived from the estimates alone (reference intervals, fastest stage
durations, staleness) are remembered in ``ShapeTimes`` until an estimate changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from policy.candidate_families import PREFILL, family_shapes, family_times
from policy.catalog_index import CatalogIndex, ShapeTimes
from policy.client_shares import client_rate_views
from policy.config import PolicyConfig
from policy.decision_context import DecisionContext, LaneGroup, PromptGroup, RestoreGroup
from policy.descriptors import StateOp
from policy.frame_queue import FrameQueue
from policy.prompt_prices import first_output_values, first_output_weight, first_token_prices
from policy.requests import RequestRecord
from policy.service import (
    ServiceHistory,
    observe_delivery,
    observe_service,
)
from policy.types import Phase, RequestHandle, RestoreNeed
from policy.utility import NS_PER_MS, IntArray, scaled
from policy.vision_prerequisites import held_rows

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
    if config.client_fairness:
        histories = client_rate_views(records, histories, config)

    n_active = 0
    n_pending_terminals = 0
    n_resident = 0
    overloaded = False  # a resident request took the last row (takes_last_row)
    decoders: list[RequestRecord] = []
    terminals: list[RequestRecord] = []
    prompts: list[RequestRecord] = []
    restorable: list[RequestRecord] = []
    # Per decoder: token rate x, delivery rate z (a missing z is priced at the admission
    # fair share, service.delivery_price), output age (requests.output_age_ns: from the
    # later of the last visible output and a queued expected delivery, QUEUE-43),
    # last served time and handle (the group's tie-break order).
    dec_x: list[float] = []
    dec_z: list[float] = []
    dec_age: list[int] = []
    dec_served: list[int] = []
    dec_handle: list[int] = []
    # One pass with the ``selectable`` / ``restorable`` rules inlined (requests.py):
    # this loop runs over every resident request on every decision.
    for r in records.values():
        if r.cancelled:
            continue
        phase = r.phase
        if phase is _RETIRED:
            continue
        n_resident += 1
        if r.took_last_row:
            overloaded = True
        need = r.restore
        if need is _NO_RESTORE:
            if phase is _DECODE:
                n_active += 1
                if r.max_output_tokens - r.output_committed - r.queued_outputs > 0:
                    decoders.append(r)
                    h = histories.get(r.handle, r.history) if histories else r.history
                    dec_x.append(h.token_rate)
                    z = h.delivery_rate
                    dec_z.append(h.fair_delivery_rate if z is None else z)
                    since = r.last_visible_ns
                    queued = r.queued_delivery_end_ns
                    if queued is not None and queued > since:
                        since = queued
                    age = start_ns - since
                    dec_age.append(age if age > 0 else 0)
                    dec_served.append(r.last_served_ns)
                    dec_handle.append(r.handle)
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
    prompt_x: list[float] = []
    prompt_z: list[float] = []
    prompt_age_ms: list[float] = []
    cursor: list[int] = []
    remaining: list[int] = []
    endpoint: list[int] = []
    reaches: list[bool] = []
    last_served: list[int] = []
    scored_rows: list[int] = []
    for i, r in enumerate(prompts):
        h = histories.get(r.handle, r.history) if histories else r.history
        prompt_x.append(h.token_rate)
        z = h.delivery_rate
        prompt_z.append(h.fair_delivery_rate if z is None else z)
        at = r.prompt_cursor
        end, next_end = r.prompt_ends()
        cursor.append(at)
        remaining.append(end - at)
        endpoint.append(next_end - at)
        reaches.append(end >= r.prompt_len)
        last_served.append(r.last_served_ns)
        waited = start_ns - (r.admitted_ns if r.arrived_ns is None else r.arrived_ns)
        prompt_age_ms.append(waited / NS_PER_MS if waited > 0 else 0.0)
        if r.scored_prompt:
            scored_rows.append(i)

    tf, beta, g = config.token_fairness, config.output_token_value, config.delivery_fairness
    prompt_price = first_token_prices(prompt_x, prompt_age_ms, config)
    age_price = decode_age_price(config, n_resident, catalog, times, overloaded=overloaded)
    e = _price_exponent(config, age_price, dec_x, dec_z, prompt_x, prompt_z,
                        max(prompt_price, default=0.0))
    sigma_dec = _reference_ms(catalog, times, "delivery", catalog.delivery_family, n_active)
    # The stream a prompt starts is delivered at the decoders' interval, or alone when
    # none decodes (looked up only for the stream-start weight, unused under the seed).
    sigma_start = sigma_dec if n_active or config.stream_start_ms <= 0 else _reference_ms(
        catalog, times, "delivery", catalog.delivery_family, 1)
    sigma_term = _reference_ms(catalog, times, "snapshot", catalog.snapshot,
                               n_pending_terminals)
    c_dec = scaled(age_price, e)
    c_term = scaled(config.terminal_age_price, e)
    dec_slope = c_dec * sigma_dec if sigma_dec is not None else 0.0
    term_slope = c_term * sigma_term if sigma_term is not None else 0.0

    # SEL-5..7 (service.py's scalar price functions, the same IEEE operations): a
    # decoder's base value is its output token price beta + f/x plus its delivery
    # price g/z, scaled, plus the age term at the planning start; a prompt row's token
    # price is 1 + f/x and its first output is worth beta + f/x + g/z.
    # Scaling by the power of two 2**-e: exact, the same as ldexp (prices are at most
    # 2**e, so nothing overflows).
    unit = 2.0 ** -e
    # The first output's value with flare's stream-start weight and finish urgency (1
    # and none under the seed); either may take it past 2**e, which a float holds (not a
    # bit-exact rule).
    start_weight = first_output_weight(config, sigma_start)
    dec_base = [(beta + tf / x + g / z) * unit + dec_slope * (age / NS_PER_MS)
                for x, z, age in zip(dec_x, dec_z, dec_age, strict=True)]
    term_value = scaled(config.terminal_value, e)
    term_base = [term_value + term_slope * (r.terminal_age_ns(start_ns) / NS_PER_MS)
                 for r in terminals]
    prompt_group = PromptGroup(
        tuple(prompts), cursor=cursor, remaining=remaining, endpoint=endpoint,
        reaches=reaches, price=[price * unit for price in prompt_price],
        finish=[value * unit for value in first_output_values(
            prompt_x, prompt_z, prompt_age_ms, cursor, config, start_weight)],
        last_served=last_served, scored=scored_rows, held=held_rows(prompts, catalog))
    restore_group = _restore_group(restorable, catalog=catalog, times=times, config=config,
                                   e=e, start_ns=start_ns, dec_slope=dec_slope,
                                   c_dec=c_dec, sigma_dec=sigma_dec, start_weight=start_weight)
    return DecisionContext(
        catalog=catalog,
        times=times,
        estimate_ns=times.estimate_ns,
        stale=times.stale_at(now_ns, ttl_ns),
        last_touched_ns=times.last_touched_ns,
        decoders=LaneGroup.build(decoders, dec_base, dec_slope, served=dec_served,
                                 handles=dec_handle),
        terminals=LaneGroup.build(terminals, term_base, term_slope),
        prompts=prompt_group,
        restorable=restore_group,
        waiting=c_dec * n_active + c_term * n_pending_terminals,
        terminal_coefficient=c_term,
        exponent=e,
        now_ns=now_ns,
        start_ns=start_ns,
        refresh_funded=refresh_funded,
        **stream_gap(config, catalog, times, n_active, decoders, queue.settled_ns(now_ns)),
    )


def stream_gap(config: PolicyConfig, catalog: CatalogIndex, times: ShapeTimes,
               streams: int, decoders: list[RequestRecord], settled_ns: int
               ) -> dict[str, float]:
    """flare's stream gap limit (``stream_gap_ratio`` r > 0, U-13) for ``streams``
    decoding streams: r, ``decode_ms`` (their decode family's sigma, SEL-16) and
    ``stream_wait_ms``, the longest a decoder has been held by frames: from its latest
    output, queued delivery or completed frame to ``settled_ns`` (publication lag
    and planning time are no frame's). Nothing when r is 0, no stream decodes or no
    decode program is measured."""
    r = config.stream_gap_ratio
    if not r or not streams:
        return {}
    decode_ms = _reference_ms(catalog, times, "gap", catalog.decode, streams)
    if decode_ms is None:
        return {}
    served = min((d.held_since_ns() for d in decoders), default=settled_ns)
    return {"stream_gap_ratio": r, "decode_ms": decode_ms,
            "stream_wait_ms": max(settled_ns - served, 0) / NS_PER_MS}


KNEE_SLACK = 0.05
"""How much longer than the widest decode program its smallest-chunk mixed program may
run for the catalog to have a throughput knee (``decode_age_price``)."""


def decode_age_price(config: PolicyConfig, resident: int, catalog: CatalogIndex,
                     times: ShapeTimes, *, overloaded: bool) -> float:
    """The decoders' output-age price c of this decision: the seed's
    ``decode_age_price`` (POL-5), or, with flare's opt-in spare-row price
    (``spare_decode_age_price`` > 0), the larger of the two while the widest decode
    program has a row no resident request holds, no resident request took the last
    row (``overloaded``: ``takes_last_row``), and the measured estimates show a knee
    there (``has_knee``; ``docs/scheduling-utility.md``, *Spare rows*)."""
    c, spare = config.decode_age_price, config.spare_decode_age_price
    if (spare > c and not overloaded and len(catalog.decode)
            and resident < catalog.batch[catalog.decode[-1]] and has_knee(catalog, times)):
        return spare
    return c


def takes_last_row(records: Mapping[RequestHandle, RequestRecord],
                   catalog: CatalogIndex) -> bool:
    """Whether a request admitted now holds the widest decode program's last row: the
    live (not cancelled, not retired) resident requests already fill every other row.
    Such a request marks an overload episode that lasts while it is resident."""
    if not len(catalog.decode):
        return False
    live = sum(1 for r in records.values() if not r.cancelled and r.phase is not _RETIRED)
    return live + 1 >= int(catalog.batch[catalog.decode[-1]])


def has_knee(catalog: CatalogIndex, times: ShapeTimes) -> bool:
    """Whether a prompt chunk rides on a full decode frame almost free: the widest
    decode program and the mixed program of its batch with the smallest prompt
    capacity are both measured, and the mixed one runs at most ``KNEE_SLACK`` longer.
    Remembered until an estimate changes."""
    key = ("knee", -1)
    cached = times.sigma_memo.get(key)
    if cached is None:
        cached = times.sigma_memo[key] = 0.0
        if len(catalog.decode):
            widest = int(catalog.decode[-1])
            rows = catalog.batch[widest]
            chunk = [int(i) for i in catalog.mixed_smallest_prompt if catalog.batch[i] == rows]
            decode_ns = int(times.estimate_ns[widest])
            mixed_ns = int(times.estimate_ns[chunk[0]]) if chunk else 0
            if decode_ns > 0 and 0 < mixed_ns <= (1.0 + KNEE_SLACK) * decode_ns:
                cached = times.sigma_memo[key] = 1.0
    return cached > 0


def _price_exponent(config: PolicyConfig, age_price: float,
                    dec_x: list[float], dec_z: list[float],
                    prompt_x: list[float], prompt_z: list[float],
                    prompt_top: float) -> int:
    """The decision's scaling exponent (SEL-20, OPEN-14): the binary exponent of the
    largest price or coefficient. Prices are ``beta + f/x``, ``g/z`` and ``1 + f/x``
    with non-negative coefficients (``PolicyConfig`` validates them) and positive
    rates, and correctly rounded division and addition are monotone, so the largest
    of each is the one at the smallest rate: ``max_i(beta + f/x_i) = beta + f/min_i x_i``
    exactly. ``prompt_top``: the largest prompt token price (``first_token_prices``;
    ``1 + f/min_i x_i`` without first-token urgency)."""
    tf, beta, g = config.token_fairness, config.output_token_value, config.delivery_fairness
    largest = max(age_price, config.terminal_value, config.terminal_age_price)
    if dec_x or prompt_x:
        p_min = min(prompt_x) if prompt_x else math.inf
        x_min = min(min(dec_x), p_min) if dec_x else p_min
        z_min = min(min(dec_z, default=math.inf), min(prompt_z, default=math.inf))
        if not (x_min > 0 and z_min > 0):
            raise ValueError(f"service rates must be positive, got {x_min!r}, {z_min!r}")
        largest = max(largest, beta + tf / x_min, g / z_min)
        if prompt_x:
            largest = max(largest, 1.0 + tf / p_min, prompt_top)
    # utility.scale_exponent of these magnitudes (all non-negative).
    if not math.isfinite(largest):
        raise ValueError(f"non-finite price or coefficient {largest!r}")
    return math.frexp(largest)[1] if largest else 0


def _fastest_ms(times: ShapeTimes, name: str, family: IntArray) -> float:
    """The fastest measured duration of a family (0 when none is measured: unknown
    stages count optimistically, PRE-24); remembered until an estimate changes."""
    key = (name, -1)
    cached = times.sigma_memo.get(key)
    if cached is None:
        est = times.estimate_ns[family]
        known = est[est > 0]
        cached = times.sigma_memo[key] = float(known.min()) / NS_PER_MS if len(known) else 0.0
    return cached


def _first_chunk(times: ShapeTimes, catalog: CatalogIndex, token_price: float,
                 finish: float, remaining: int) -> tuple[float, float]:
    """A multistage prompt row's first chunk: the measured prefill shape with the best
    value per millisecond (the largest capacity when none is measured), as
    ``(value, duration_ms)``."""
    fam = family_shapes(catalog, PREFILL)
    est = family_times(times, PREFILL, fam.shapes).est
    best: tuple[float, float] | None = None
    for cap, e in zip(fam.caps, est, strict=True):
        value = token_price * min(cap, remaining) + (finish if cap >= remaining else 0.0)
        ms = e / NS_PER_MS
        if ms > 0 and (best is None or value / ms > best[0] / best[1]):
            best = (value, ms)
    if best is None:
        return token_price * remaining + finish, 0.0
    return best


def _restore_group(restorable: list[RequestRecord], *, catalog: CatalogIndex,
                   times: ShapeTimes, config: PolicyConfig, e: int, start_ns: int,
                   dec_slope: float, c_dec: float, sigma_dec: float | None,
                   start_weight: float) -> RestoreGroup:
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
    stage_ms = {StateOp.RESTORE: _fastest_ms(times, "restore", catalog.restore),
                StateOp.INITIALIZE: _fastest_ms(times, "initialize", catalog.initialize)}
    decode_ms = _fastest_ms(times, "decode", catalog.decode)
    decoding, base, slopes, further, cont = [], [], [], [], []
    token_price, finish_value, remaining = [], [], []
    next_op, multistages = [], []
    tf, beta, g = config.token_fairness, config.output_token_value, config.delivery_fairness
    for r in restorable:
        stages = r.remaining_stages
        chain_ms: float = 0
        for op in stages:  # sum() of the stage durations, in order
            chain_ms += stage_ms.get(op, 0.0)
        after_next_ms = chain_ms - stage_ms.get(stages[0], 0.0)
        multistage = len(stages) > 1
        slope = dec_slope
        if multistage:
            slope = c_dec * (chain_ms + sigma_dec) if sigma_dec is not None else 0.0
        is_decoding = r.phase is Phase.DECODE
        # service.prefill_token_price, output_token_price + delivery_price, scaled.
        h = r.history
        fair = tf / h.token_rate
        z = h.delivery_rate if h.delivery_rate is not None else h.fair_delivery_rate
        price = math.ldexp(1.0 + fair, -e)
        finish = math.ldexp(beta + fair + g / z, -e)
        end = r.prompt_ends()[0]
        left = end - r.prompt_cursor if not is_decoding else 0
        finish_here = 0.0 if end < r.prompt_len else finish * start_weight
        decoding.append(is_decoding)
        slopes.append(slope)
        token_price.append(price)
        finish_value.append(finish_here)
        remaining.append(left)
        next_op.append(stages[0])
        multistages.append(multistage)
        if is_decoding:
            base.append(finish + slope * (r.output_age_ns(start_ns) / NS_PER_MS))
            further.append(after_next_ms + decode_ms)
            cont.append(0.0)
        elif multistage:
            base.append(0.0)
            value, chunk_ms = _first_chunk(times, catalog, price, finish_here, left)
            further.append(after_next_ms + chunk_ms)
            cont.append(value)
        else:  # the pair lookahead scores its first chunk exactly
            base.append(0.0)
            further.append(after_next_ms)
            cont.append(0.0)
    return RestoreGroup(
        records=tuple(restorable), decoding=tuple(decoding), base=tuple(base),
        slope=dec_slope, token_price=tuple(token_price), finish_value=tuple(finish_value),
        remaining=tuple(remaining), next_op=tuple(next_op), multistage=tuple(multistages),
        slopes=tuple(slopes), further_ms=tuple(further), continuation_value=tuple(cont),
    )
