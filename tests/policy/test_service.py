"""Service history, prices and normalizers, as docs/scheduling-utility.md defines them.

Formula ids U-1..U-12 refer to docs/scheduling-utility.md (CAT-6: each formula is tested).
"""

from __future__ import annotations

import math
import pathlib
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.config import PolicyConfig
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.service import (
    FALLBACK_RATE_PER_MS,
    RATE_FLOOR_PER_MS,
    Normalizers,
    ServiceHistory,
    delivery_price,
    new_history,
    normalizers_from_catalog,
    observe_delivery,
    observe_service,
    output_token_price,
    prefill_token_price,
    redo_delivery,
    service_interval_ns,
    smoothing_decay,
)

MS = 1_000_000
CONFIG = PolicyConfig()
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "scheduling-utility.md"


def decode(b: int) -> GraphShape:
    return GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1, packed_capacity=b)


def prefill(c: int) -> GraphShape:
    return GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=c)


def history(x: float, z: float | None = None) -> ServiceHistory:
    return ServiceHistory(token_rate=x, delivery_rate=z)


def test_sel_5_6_7_u_1_2_3_prices() -> None:
    """Covers SEL-5, SEL-6, SEL-7, OPEN-2, U-1, U-2, U-3: f=16, beta=64, g=4."""
    h = history(4.0, 2.0)
    assert prefill_token_price(h, CONFIG) == 5.0
    assert output_token_price(h, CONFIG) == 68.0
    assert delivery_price(h, CONFIG) == 2.0


def test_open_2_prices_bind_to_config_fields() -> None:
    """Covers OPEN-2: f, beta and g are token_fairness, output_token_value, delivery_fairness."""
    c = PolicyConfig(token_fairness=3.0, output_token_value=10.0, delivery_fairness=7.0)
    h = history(2.0, 0.5)
    assert prefill_token_price(h, c) == 1 + 3.0 / 2.0
    assert output_token_price(h, c) == 10 + 3.0 / 2.0
    assert delivery_price(h, c) == 7.0 / 0.5


def test_pol_12_zero_fairness_removes_the_preference() -> None:
    """Covers POL-12: token_fairness=0 gives prefill price exactly 1; g=0 zero delivery price."""
    c = PolicyConfig(token_fairness=0.0, delivery_fairness=0.0)
    h = history(RATE_FLOOR_PER_MS, RATE_FLOOR_PER_MS)
    assert prefill_token_price(h, c) == 1.0
    assert output_token_price(h, c) == 64.0
    assert delivery_price(h, c) == 0.0


def test_u_4_exact_update_formula() -> None:
    """Covers SEL-9, SEL-10 (U-4): x <- x*exp(-dt/tau) + (tokens/dt)*(1-exp(-dt/tau))."""
    h = history(2.0)
    observe_service(h, tokens=30, interval_ms=10.0, config=CONFIG)
    a = math.exp(-10.0 / 100.0)
    assert h.token_rate == pytest.approx(2.0 * a + 3.0 * (1 - a), rel=1e-15)
    assert smoothing_decay(10.0, CONFIG) == a


def test_sel_9_price_trajectory_on_a_recorded_trace() -> None:
    """Covers SEL-9, ACCT-11, U-1, U-4: prices along a recorded trace of served/unserved frames.

    Expected values were computed by hand from U-4 with tau = 100 ms:
    x1 = 1*e^-0.1 + 2*(1 - e^-0.1), x2 = x1*e^-0.2, x3 = x2*e^-0.05 + 4*(1 - e^-0.05).
    """
    h = history(1.0)
    trace = [(20, 10.0), (0, 20.0), (20, 5.0)]  # (committed tokens, measured interval ms)
    e1, e2, e3 = math.exp(-0.1), math.exp(-0.2), math.exp(-0.05)
    x1 = e1 + 2 * (1 - e1)
    x2 = x1 * e2
    x3 = x2 * e3 + 4 * (1 - e3)
    prices = []
    for tokens, dt in trace:
        observe_service(h, tokens=tokens, interval_ms=dt, config=CONFIG)
        prices.append(prefill_token_price(h, CONFIG))
    assert prices == pytest.approx([1 + 16 / x1, 1 + 16 / x2, 1 + 16 / x3], rel=1e-14)
    assert prices[1] > prices[2] > prices[0]  # starved, partly recovered, best served


def test_u_4_time_constant_is_adaptation_ms() -> None:
    """Covers POL-8 (U-4): after one tau of zero service the rate falls to 1/e."""
    for tau in (50.0, 100.0, 400.0):
        c = PolicyConfig(adaptation_ms=tau)
        h = history(5.0)
        observe_service(h, tokens=0, interval_ms=tau, config=c)
        assert h.token_rate == pytest.approx(5.0 / math.e)


@settings(deadline=None)
@given(
    x0=st.floats(min_value=0.01, max_value=100.0),
    rate=st.integers(min_value=0, max_value=50),
    dt1=st.integers(min_value=1, max_value=200),
    dt2=st.integers(min_value=1, max_value=200),
)
def test_u_4_splitting_an_interval_changes_nothing(x0: float, rate: int, dt1: int,
                                                   dt2: int) -> None:
    """Covers U-4: the update is the exact solution of dx/dt = (r - x)/tau at constant r,
    so two intervals at one service rate equal one interval of their combined length."""
    split, whole = history(x0), history(x0)
    observe_service(split, tokens=rate * dt1, interval_ms=float(dt1), config=CONFIG)
    observe_service(split, tokens=rate * dt2, interval_ms=float(dt2), config=CONFIG)
    observe_service(whole, tokens=rate * (dt1 + dt2), interval_ms=float(dt1 + dt2),
                    config=CONFIG)
    assert split.token_rate == pytest.approx(whole.token_rate, rel=1e-9)


def test_acct_11_cat_2_unselected_participants_decay_and_prices_rise() -> None:
    """Covers ACCT-11, CAT-2: zero service lowers x, so the starved request's prices rise."""
    served, waiting = history(1.0), history(1.0)
    for _ in range(5):
        observe_service(served, tokens=20, interval_ms=10.0, config=CONFIG)
        observe_service(waiting, tokens=0, interval_ms=10.0, config=CONFIG)
    assert waiting.token_rate < 1.0 < served.token_rate
    assert prefill_token_price(waiting, CONFIG) > prefill_token_price(served, CONFIG)
    assert output_token_price(waiting, CONFIG) > output_token_price(served, CONFIG)


def test_u_7_floor_keeps_prices_finite() -> None:
    """Covers U-7: after a very long starvation the rate is the floor and prices are finite."""
    h = history(3.0, 3.0)
    observe_service(h, tokens=0, interval_ms=1e9, config=CONFIG)
    observe_delivery(h, deliveries=0, interval_ms=1e9, config=CONFIG)
    assert h.token_rate == RATE_FLOOR_PER_MS == 1e-6
    assert h.delivery_rate == RATE_FLOOR_PER_MS
    assert prefill_token_price(h, CONFIG) == 1 + 16e6
    assert delivery_price(h, CONFIG) == 4e6


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.floats(1e-3, 1e7)), max_size=40))
def test_u_7_prices_stay_finite_under_any_service(steps: list[tuple[int, float]]) -> None:
    """Property: any sequence of service observations keeps rates >= floor, prices finite."""
    h = history(1.0, 1.0)
    for tokens, dt in steps:
        observe_service(h, tokens=tokens, interval_ms=dt, config=CONFIG)
        observe_delivery(h, deliveries=min(tokens, 1), interval_ms=dt, config=CONFIG)
        assert h.token_rate >= RATE_FLOOR_PER_MS
        assert h.delivery_rate is not None and h.delivery_rate >= RATE_FLOOR_PER_MS
        for price in (prefill_token_price(h, CONFIG), output_token_price(h, CONFIG),
                      delivery_price(h, CONFIG)):
            assert math.isfinite(price) and price > 0


def test_acct_8_zero_or_invalid_interval_contributes_nothing() -> None:
    """Covers ACCT-8: only a positive measured interval updates history."""
    h = history(2.0, 0.5)
    for dt in (0.0, -1.0, math.nan, math.inf):
        observe_service(h, tokens=100, interval_ms=dt, config=CONFIG)
        observe_delivery(h, deliveries=1, interval_ms=dt, config=CONFIG)
    assert (h.token_rate, h.delivery_rate) == (2.0, 0.5)
    with pytest.raises(ValueError):
        observe_service(h, tokens=-1, interval_ms=1.0, config=CONFIG)
    with pytest.raises(ValueError):
        observe_delivery(h, deliveries=-1, interval_ms=1.0, config=CONFIG)


def test_acct_8_9_10_dur_16_service_interval() -> None:
    """Covers ACCT-8, ACCT-9, ACCT-10, DUR-16: queued = device, isolated = max(device, wall)."""
    t = ExecutionTiming(device_intervals_ns=(6 * MS, 8 * MS), wall_ns=20 * MS,
                        readiness_delay_ns=2 * MS)
    assert service_interval_ns(t, isolated=False) == 8 * MS
    assert service_interval_ns(t, isolated=True) == 20 * MS
    assert t.cost_sample_ns == 6 * MS  # the cost sample is corrected, the interval is raw
    fast_wall = ExecutionTiming(device_intervals_ns=(9 * MS,), wall_ns=3 * MS)
    assert service_interval_ns(fast_wall, isolated=True) == 9 * MS
    missing = ExecutionTiming(device_intervals_ns=(0,), wall_ns=20 * MS)
    assert service_interval_ns(missing, isolated=True) == 0
    assert service_interval_ns(missing, isolated=False) == 0


def test_acct_19_u_6_first_burst_initialises_delivery_rate() -> None:
    """Covers ACCT-19, SEL-8 (U-6): missing until the first burst; then 1/12 per ms."""
    h = new_history(Normalizers(2.0, 0.25))
    assert h.delivery_rate is None
    observe_delivery(h, deliveries=0, interval_ms=12.0, config=CONFIG)
    assert h.delivery_rate is None
    observe_delivery(h, deliveries=1, interval_ms=12.0, config=CONFIG)
    assert h.delivery_rate == 1 / 12
    observe_delivery(h, deliveries=0, interval_ms=12.0, config=CONFIG)
    a = math.exp(-12 / 100)
    assert h.delivery_rate == pytest.approx((1 / 12) * a)


def test_u_5_delivery_update_formula() -> None:
    """Covers U-5: z <- z*exp(-dt/tau) + (deliveries/dt)*(1-exp(-dt/tau))."""
    h = history(1.0, 0.05)
    observe_delivery(h, deliveries=1, interval_ms=20.0, config=CONFIG)
    a = math.exp(-0.2)
    assert h.delivery_rate == pytest.approx(0.05 * a + (1 / 20) * (1 - a), rel=1e-15)


def test_missing_delivery_is_priced_at_the_fair_share_rate() -> None:
    """Covers U-6: a decoder with no burst yet pays g / z_fair, finite."""
    h = new_history(Normalizers(token_rate_per_ms=3.0, delivery_rate_per_ms=0.5))
    assert h.token_rate == 3.0
    assert delivery_price(h, CONFIG) == 4.0 / 0.5


def test_acct_13_14_15_publication_replaces_the_zero_delivery_update() -> None:
    """Covers ACCT-13, ACCT-14, ACCT-15: zero at completion, one at publication, once."""
    h = history(1.0, 0.1)
    before = h.delivery_rate
    observe_delivery(h, deliveries=0, interval_ms=10.0, config=CONFIG)  # completion
    after_completion = h.delivery_rate
    assert after_completion is not None and after_completion < 0.1
    redo_delivery(h, before=before, deliveries=1, interval_ms=10.0, config=CONFIG)
    reference = history(1.0, 0.1)
    observe_delivery(reference, deliveries=1, interval_ms=10.0, config=CONFIG)
    assert h.delivery_rate == reference.delivery_rate
    # A second publication for the same fence (later tokens of the burst) redoes with the
    # same saved rate and one delivery: the count does not grow.
    redo_delivery(h, before=before, deliveries=1, interval_ms=10.0, config=CONFIG)
    assert h.delivery_rate == reference.delivery_rate


def test_acct_19_publication_after_missing_history() -> None:
    """Covers ACCT-14, ACCT-19: the corrected first burst initialises the coordinate."""
    h = new_history(Normalizers(1.0, 1.0))
    before = h.delivery_rate
    observe_delivery(h, deliveries=0, interval_ms=12.0, config=CONFIG)
    redo_delivery(h, before=before, deliveries=1, interval_ms=12.0, config=CONFIG)
    assert h.delivery_rate == 1 / 12


def test_u_8_normalizers_from_catalog() -> None:
    """Covers ACCT-2 (U-8a, U-8b): best aggregate rate for n requests, shared equally."""
    measured = {decode(1): 5 * MS, decode(4): 8 * MS, prefill(512): 32 * MS}
    n = normalizers_from_catalog(measured, population=4)
    # decode B=4: 4/8 = 0.5 tokens/ms; prefill 512/32 = 16 tokens/ms -> 16/4.
    assert n.token_rate_per_ms == 16 / 4
    # deliveries: max(1/5, 4/8) = 0.5 per ms, shared by 4.
    assert n.delivery_rate_per_ms == 0.5 / 4
    # With two requests a B=4 decode serves only two: min(B, n) = 2.
    n2 = normalizers_from_catalog({decode(4): 8 * MS, decode(1): 5 * MS}, population=2)
    assert n2.delivery_rate_per_ms == max(1 / 5, 2 / 8) / 2
    assert n2.token_rate_per_ms == n2.delivery_rate_per_ms


def test_u_8_fallback_and_ignored_kinds() -> None:
    """Covers U-8: nothing measured -> 1.0/ms; speculative shapes do not normalise."""
    spec = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=2, token_capacity=4,
                      proposal_depth=3, packed_capacity=8, binding=TargetBinding.QUERY_LENGTH)
    n = normalizers_from_catalog({spec: 1 * MS, decode(2): 0}, population=0)
    assert n == Normalizers(FALLBACK_RATE_PER_MS, FALLBACK_RATE_PER_MS)
    only_prefill = normalizers_from_catalog({prefill(64): 4 * MS}, population=1)
    assert only_prefill == Normalizers(16.0, FALLBACK_RATE_PER_MS)


def test_u_8_normalizers_are_floored() -> None:
    n = normalizers_from_catalog({decode(1): 10**18}, population=64)
    assert n.token_rate_per_ms == RATE_FLOOR_PER_MS
    assert n.delivery_rate_per_ms == RATE_FLOOR_PER_MS


def test_acct_20_21_rates_are_physical_and_survive_normalizer_changes() -> None:
    """Covers ACCT-20, ACCT-21: a new catalog changes only new histories."""
    old = normalizers_from_catalog({decode(4): 8 * MS}, population=4)
    h = new_history(old)
    observe_service(h, tokens=3, interval_ms=8.0, config=CONFIG)
    observe_delivery(h, deliveries=1, interval_ms=8.0, config=CONFIG)
    snapshot = h.copy()
    prices = (prefill_token_price(h, CONFIG), output_token_price(h, CONFIG),
              delivery_price(h, CONFIG))
    new = normalizers_from_catalog({decode(4): 2 * MS}, population=4)
    assert new != old
    newcomer = new_history(new)
    assert newcomer.token_rate == new.token_rate_per_ms
    # The existing history is untouched: same physical rates, same prices.
    assert h == snapshot
    assert prices == (prefill_token_price(h, CONFIG), output_token_price(h, CONFIG),
                      delivery_price(h, CONFIG))


def test_copy_is_independent() -> None:
    h = history(2.0, 1.0)
    c = h.copy()
    observe_service(c, tokens=0, interval_ms=50.0, config=CONFIG)
    assert h.token_rate == 2.0 and c.token_rate < 2.0


def test_cat_6_doc_formulas_are_all_cited_by_tests() -> None:
    """Covers CAT-6, OPEN-1: every U-n formula id in the doc is cited by this test file."""
    ids = set(re.findall(r"\*\*(U-\d+)[ab]?\*\*", DOC.read_text()))
    assert ids == {f"U-{i}" for i in range(1, 15)}
    source = pathlib.Path(__file__).read_text()
    for formula in ids:
        assert re.search(rf"Covers[^\n]*\b{formula}\b", source), formula


def test_first_output_weight_is_the_stream_it_starts() -> None:
    """Covers U-12: the first output is worth ``max(1, H/sigma)`` output tokens, one
    without a delivery reference, and exactly one under every seed preset."""
    from policy.config import policy_preset
    from policy.prompt_prices import first_output_weight

    start = PolicyConfig(stream_start_ms=100.0)
    assert first_output_weight(start, 6.25) == 16.0
    assert first_output_weight(start, 250.0) == 1.0
    assert first_output_weight(start, None) == 1.0
    for name in ("balanced", "throughput"):
        assert first_output_weight(policy_preset(name), 6.25) == 1.0


def test_stream_gap_limit_inputs() -> None:
    """Covers U-13: the limit's inputs are r, the decode frame serving the streams alone
    and the longest wait since a decoder's latest output, queued delivery or completed
    frame (an output still being published does not count as waiting); there is
    none under every seed preset, with no stream decoding, or with no decode program
    measured."""
    from synthetic_catalog import MS, decode, duration_ns, measured_scheduler

    from policy.config import policy_preset
    from policy.decision import stream_gap
    from policy.requests import RequestRecord
    from policy.service import Normalizers, new_history
    from policy.types import RequestHandle

    def stream(visible: int, settled: int = 0, queued: int | None = None) -> RequestRecord:
        rec = RequestRecord(handle=RequestHandle(visible), epoch=0, admitted_ns=0,
                            prompt_len=8, cached_prefix_len=0, max_output_tokens=9,
                            history=new_history(Normalizers(0.5, 0.05)))
        rec.last_visible_ns, rec.last_completed_ns = visible * MS, settled * MS
        rec.queued_delivery_end_ns = None if queued is None else queued * MS
        return rec

    s = measured_scheduler((decode(1), decode(4), decode(8)))
    catalog, times = s._catalog, s._shape_times()
    limited = PolicyConfig(stream_gap_ratio=1.5)
    decode_ms = duration_ns(decode(4)) / MS  # the reference for three streams

    def wait(*decoders: RequestRecord) -> float:
        gap = stream_gap(limited, catalog, times, 3, list(decoders), 20 * MS)
        assert gap["stream_gap_ratio"] == 1.5
        assert gap["decode_ms"] == pytest.approx(decode_ms)
        return gap["stream_wait_ms"]

    assert wait(stream(18), stream(15)) == pytest.approx(5.0)  # the longest wait
    assert wait(stream(15, settled=19)) == pytest.approx(1.0)  # completed, unpublished
    assert wait(stream(15, settled=12, queued=17)) == pytest.approx(3.0)
    assert wait(stream(25)) == 0.0
    assert stream_gap(limited, catalog, times, 0, [], 0) == {}
    bare = measured_scheduler(())
    assert stream_gap(limited, bare._catalog, bare._shape_times(), 3, [stream(1)], 0) == {}
    for name in ("balanced", "throughput"):
        assert stream_gap(policy_preset(name), catalog, times, 3, [stream(1)], 0) == {}


def test_steady_is_first_token_with_the_gap_limit_and_finish_urgency() -> None:
    """Covers U-13, U-14: ``steady`` is first-token with u = v = 5 and r = 1.15; the
    finish urgency is off under every other preset (its pricing:
    ``tests/policy/test_finish_urgency.py``)."""
    from policy.config import POLICY_PRESETS, policy_preset

    steady, first = policy_preset("steady"), policy_preset("first-token")
    assert (steady.stream_gap_ratio, steady.prompt_age_price) == (1.15, 5.0)
    assert steady.finish_age_price == 5.0
    assert replace(steady, stream_gap_ratio=0.0, prompt_age_price=0.03,
                   finish_age_price=0.0) == first
    assert [n for n, c in POLICY_PRESETS.items() if c.finish_age_price] == ["steady"]


def test_rates_age_by_measured_service_time_only() -> None:
    """Covers U-9: tau counts measured frame intervals; a rate halves over tau*ln 2 ms of
    service without tokens, and waiting while nothing runs ages nobody."""
    from synthetic_catalog import MS, decode, measured_scheduler

    h = history(2.0, 1.0)
    observe_service(h, tokens=0, interval_ms=CONFIG.adaptation_ms * math.log(2), config=CONFIG)
    assert h.token_rate == pytest.approx(1.0)
    s = measured_scheduler((decode(1),))
    handle = s.admit(prompt_len=64, max_output_tokens=8)
    before = s.request(handle).history.copy()
    s.advance_to(s.now_ns + 10_000 * MS)
    after = s.request(handle).history
    assert (after.token_rate, after.delivery_rate) == (before.token_rate, before.delivery_rate)


def test_first_token_urgency_price() -> None:
    """Covers U-10: ``1 + f/x + u*A`` per prompt token; u = 0 is SEL-5's price."""
    from dataclasses import replace

    from policy.prompt_prices import first_token_prices

    urgent = replace(CONFIG, prompt_age_price=0.03)
    assert first_token_prices([4.0], [100.0], CONFIG) == [prefill_token_price(history(4.0, 1.0),
                                                                              CONFIG)]
    assert first_token_prices([4.0], [100.0], urgent) == [pytest.approx(1 + 16 / 4 + 3.0)]


def test_client_share_prices() -> None:
    """Covers U-11: with client weight ``w_c`` the prices are ``1 + w_c f/x``,
    ``beta + w_c f/x`` and ``w_c g/z``; s = 0 (the seed presets) leaves every price."""
    from dataclasses import replace

    from synthetic_catalog import decode, measured_scheduler

    from policy.client_shares import client_rate_views

    fair = replace(CONFIG, client_fairness=1.0)
    s = measured_scheduler((decode(4),), fair)
    handles = [s.admit(prompt_len=8, max_output_tokens=4) for _ in range(4)]
    for h, client in zip(handles, ("heavy", "heavy", "heavy", "light"), strict=True):
        s.assign_client(h, client)
        s.request(h).history.token_rate = 2.0
        s.request(h).history.delivery_rate = 0.5
    views = client_rate_views(s._records, {}, fair)
    light, heavy = views[handles[3]], views[handles[0]]
    w_light, w_heavy = 4 / 2, 4 / 6
    assert prefill_token_price(light, fair) == pytest.approx(1 + w_light * 16 / 2.0)
    assert output_token_price(heavy, fair) == pytest.approx(64 + w_heavy * 16 / 2.0)
    assert delivery_price(light, fair) == pytest.approx(w_light * 4 / 0.5)
    # Weight one everywhere: no view, every request is priced from its stored history.
    assert client_rate_views(s._records, {}, CONFIG) == {}
