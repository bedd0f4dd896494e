"""Test helpers that place requests directly in a chosen phase and price state, and an
independent implementation of the seed's F-SEL formula used to check the selector.

The reference scorer below is written from the seed text (*Useful service and
selection*) with plain Python arithmetic; it shares only the price gradients of
``policy/service.py`` (SEL-5, SEL-6, SEL-7), so a bug in the selector's vectorised arithmetic,
cohort choice or scaling shows up as a mismatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from synthetic_catalog import MS

from policy import GraphKind, GraphShape, Phase, RequestHandle, Scheduler
from policy.service import delivery_price, output_token_price, prefill_token_price


def make_decoder(s: Scheduler, *, token_rate: float, delivery_rate: float | None,
                 age_ms: float, max_output_tokens: int = 1000) -> RequestHandle:
    h = s.admit(prompt_len=64, max_output_tokens=max_output_tokens)
    rec = s.request(h)
    rec.phase = Phase.DECODE
    rec.prompt_cursor = 64
    rec.output_committed = 1
    rec.history.token_rate = token_rate
    rec.history.delivery_rate = delivery_rate
    rec.last_visible_ns = s.now_ns - round(age_ms * MS)
    return h


def make_prompt(s: Scheduler, *, prompt_len: int, token_rate: float,
                cursor: int = 0) -> RequestHandle:
    h = s.admit(prompt_len=prompt_len, max_output_tokens=16)
    rec = s.request(h)
    rec.prompt_cursor = cursor
    rec.history.token_rate = token_rate
    return h


def plan_beside_decoders(s: Scheduler, decoders: int, *, age_ms: float) -> GraphShape:
    """Add ``decoders`` decoding requests (rates 1, last output ``age_ms`` ago) and
    return the shape of the plan the scheduler then makes."""
    for _ in range(decoders):
        make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=age_ms)
    plan = s.plan()
    assert plan is not None
    return plan.shape


@dataclass(frozen=True)
class Option:
    shape: GraphShape
    prompt: RequestHandle | None
    prompt_tokens: int
    decoders: tuple[RequestHandle, ...]
    rate: float


def sigma_ms(s: Scheduler, kinds: Iterable[GraphKind], k: int) -> float | None:
    wanted = set(kinds)
    best = None
    if k == 0:
        return None
    for shape in s.catalog:
        est = s.estimates.estimate_ns(shape)
        if shape.kind in wanted and est > 0:
            per = (est / MS) / min(shape.batch_capacity, k)
            best = per if best is None else min(best, per)
    return None if best is None or k == 0 else k * best


def reference_rate(s: Scheduler, shape: GraphShape, prompt: RequestHandle | None,
                   prompt_tokens: int, decoders: Sequence[RequestHandle]) -> float:
    """F-SEL from the seed text for one explicit cohort (unscaled)."""
    cfg = s.config
    active = [h for h in s.handles() if s.phase(h) is Phase.DECODE]
    sigma = sigma_ms(s, (GraphKind.DECODE, GraphKind.MIXED), len(active)) or 0.0
    t = s.estimates.estimate_ns(shape) / MS
    value = 0.0
    if prompt is not None:
        rec = s.request(prompt)
        value += prompt_tokens * prefill_token_price(rec.history, cfg)
        if rec.prompt_cursor + prompt_tokens >= rec.prompt_len:
            value += output_token_price(rec.history, cfg) + delivery_price(rec.history, cfg)
    for h in decoders:
        rec = s.request(h)
        age = (s.now_ns - rec.last_visible_ns) / MS
        value += output_token_price(rec.history, cfg) + delivery_price(rec.history, cfg)
        value += cfg.decode_age_price * sigma * (age + t)
    return value / t - t / 2.0 * cfg.decode_age_price * len(active)


def exhaustive_options(s: Scheduler) -> list[Option]:
    """Every legal cohort of every mixed and decode shape (VER-11)."""
    decoders = [h for h in s.handles() if s.phase(h) is Phase.DECODE]
    prompts = [h for h in s.handles() if s.phase(h) is Phase.PREFILL]
    options = []
    for shape in s.catalog:
        if shape.kind not in (GraphKind.MIXED, GraphKind.DECODE):
            continue
        prompt_choices: list[RequestHandle | None] = [None]
        if shape.kind is GraphKind.MIXED:
            prompt_choices += prompts
        for p in prompt_choices:
            rows = shape.batch_capacity - (p is not None)
            tokens = 0
            if p is not None:
                rec = s.request(p)
                tokens = min(shape.prefill_capacity, rec.prompt_len - rec.prompt_cursor)
            for m in range(rows + 1):
                for cohort in itertools.combinations(decoders, m):
                    if p is None and not cohort:
                        continue
                    options.append(Option(shape, p, tokens, cohort,
                                          reference_rate(s, shape, p, tokens, cohort)))
    return options
