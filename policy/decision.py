"""Build one decision's inputs: projected prices and ages, sigma, scaled lane values.

This module owns the step between the scheduler's stored state and the selector:

- projection (QUEUE-33, QUEUE-41..43): each queued frame's frozen expected service is
  folded into *copies* of request histories over the frame's expected interval, with
  zero service for its other participants, and ages are taken at the queue's expected
  end; a request with a queued expected delivery ages from that delivery. Stored
  histories and ages are never touched (QUEUE-42, QUEUE-44..46);
- the reference intervals (SEL-15..17, MIX-23): one for delivery-bearing streams over
  measured decode and mixed shapes, one for pending terminals over measured snapshot
  shapes (PRE-44); prefill-only requests never enlarge K;
- the shared scaling exponent (SEL-20) and every lane's scaled base value and age slope;
- the common waiting coefficient over all active decoders and pending terminals
  (SEL-19, PRE-45, SEL-8: prefill-only requests add none).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from policy.config import PolicyConfig
from policy.cost import DurationEstimates
from policy.descriptors import GraphKind, StateOp
from policy.frame_queue import FrameQueue
from policy.requests import RequestRecord
from policy.selection import CatalogIndex, DecisionContext, LaneGroup, PromptGroup
from policy.service import (
    ServiceHistory,
    delivery_price,
    observe_delivery,
    observe_service,
    output_token_price,
    prefill_token_price,
)
from policy.types import Phase, RequestHandle
from policy.utility import NS_PER_MS, reference_interval_ms, scale_exponent, scaled


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


def _measured(estimates: DurationEstimates, catalog: CatalogIndex,
              kinds: Iterable[GraphKind], op: StateOp | None = None
              ) -> list[tuple[object, int]]:
    wanted = set(kinds)
    out: list[tuple[object, int]] = []
    for s in catalog.shapes:
        if s.kind in wanted and (op is None or s.state_op is op):
            est = estimates.estimate_ns(s)
            if est > 0:
                out.append((s, est))
    return out


def build_context(
    *,
    records: Mapping[RequestHandle, RequestRecord],
    catalog: CatalogIndex,
    estimates: DurationEstimates,
    config: PolicyConfig,
    queue: FrameQueue,
    now_ns: int,
    refresh_funded: bool,
) -> DecisionContext:
    """Everything ``selection.select`` needs for a decision at the queue's expected end."""
    start_ns = queue.expected_end_ns(now_ns)
    histories = projected_histories(records, queue, config) if len(queue) else {}

    def hist(r: RequestRecord) -> ServiceHistory:
        return histories.get(r.handle, r.history)

    active_decoders: list[RequestRecord] = []
    decoders: list[RequestRecord] = []
    terminals: list[RequestRecord] = []
    prompts: list[RequestRecord] = []
    for r in records.values():
        if r.cancelled or r.phase is Phase.RETIRED:
            continue
        if r.phase is Phase.DECODE:
            active_decoders.append(r)
            if r.selectable:
                decoders.append(r)
        elif r.phase is Phase.TERMINAL:
            if r.selectable:
                terminals.append(r)
        elif r.phase is Phase.PREFILL and r.selectable:
            prompts.append(r)
    pending_terminals = [r for r in records.values()
                         if r.phase is Phase.TERMINAL and not r.cancelled]

    dec_prices = [(output_token_price(hist(r), config), delivery_price(hist(r), config))
                  for r in decoders]
    prompt_prices = [(prefill_token_price(hist(r), config), output_token_price(hist(r), config),
                      delivery_price(hist(r), config)) for r in prompts]
    magnitudes: list[float] = [config.decode_age_price, config.terminal_value,
                               config.terminal_age_price]
    for pair in dec_prices:
        magnitudes.extend(pair)
    for triple in prompt_prices:
        magnitudes.extend(triple)
    e = scale_exponent(magnitudes)

    sigma_dec = reference_interval_ms(
        _measured(estimates, catalog, (GraphKind.DECODE, GraphKind.MIXED)),  # type: ignore[arg-type]
        len(active_decoders))
    sigma_term = reference_interval_ms(
        _measured(estimates, catalog, (GraphKind.STATE,), StateOp.SNAPSHOT),  # type: ignore[arg-type]
        len(pending_terminals))
    c_dec = scaled(config.decode_age_price, e)
    c_term = scaled(config.terminal_age_price, e)
    dec_slope = c_dec * sigma_dec if sigma_dec is not None else 0.0
    term_slope = c_term * sigma_term if sigma_term is not None else 0.0

    dec_base = [
        scaled(op, e) + scaled(dp, e) + dec_slope * (r.output_age_ns(start_ns) / NS_PER_MS)
        for r, (op, dp) in zip(decoders, dec_prices, strict=True)
    ]
    term_value = scaled(config.terminal_value, e)
    term_base = [term_value + term_slope * (r.terminal_age_ns(start_ns) / NS_PER_MS)
                 for r in terminals]

    n = len(prompts)
    logical_end = np.array([r.logical_prompt_end() for r in prompts], dtype=np.int64)
    cursor = np.array([r.prompt_cursor for r in prompts], dtype=np.int64)
    prompt_group = PromptGroup(
        records=tuple(prompts),
        cursor=cursor,
        logical_remaining=logical_end - cursor if n else np.zeros(0, dtype=np.int64),
        endpoint_remaining=np.array([r.next_endpoint() - r.prompt_cursor for r in prompts],
                                    dtype=np.int64),
        reaches_prompt_end=np.array([r.logical_prompt_end() >= r.prompt_len for r in prompts],
                                    dtype=np.bool_),
        token_price=np.array([scaled(pp, e) for pp, _, _ in prompt_prices], dtype=np.float64),
        finish_value=np.array([scaled(op, e) + scaled(dp, e) for _, op, dp in prompt_prices],
                              dtype=np.float64),
        scored=np.array([r.scored_prompt for r in prompts], dtype=np.bool_),
        last_served=np.array([r.last_served_ns for r in prompts], dtype=np.int64),
    )
    shapes = catalog.shapes
    return DecisionContext(
        catalog=catalog,
        estimate_ns=np.array([estimates.estimate_ns(s) for s in shapes], dtype=np.int64),
        stale=np.array([estimates.is_stale(s, now_ns) for s in shapes], dtype=np.bool_),
        last_touched_ns=np.array([estimates.last_touched_ns(s) for s in shapes],
                                 dtype=np.int64),
        decoders=LaneGroup.build(decoders, dec_base, dec_slope),
        terminals=LaneGroup.build(terminals, term_base, term_slope),
        prompts=prompt_group,
        waiting=c_dec * len(active_decoders) + c_term * len(pending_terminals),
        exponent=e,
        now_ns=now_ns,
        start_ns=start_ns,
        refresh_funded=refresh_funded,
    )
