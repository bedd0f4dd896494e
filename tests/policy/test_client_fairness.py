"""flare's per-client fairness extension (``client_fairness``, the ``client-fair`` preset):
each request's fairness prices are weighted by its client's share ``(n / (k*n_c))**s``.

An opt-in departure from the seed's request-level fairness (CAT-2, SEL-5..7;
``docs/scheduling-utility.md``, U-11). The seed presets keep per-request prices, which
these tests also pin; stored rates never change (SEL-10, ACCT-21)."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from selection_setup import make_decoder
from synthetic_catalog import decode, measured_scheduler
from test_baselines_sarathi import MIXED_CATALOG

from ops.loadgen.workload import RequestPlan
from ops.sim.costs import SyntheticCosts
from ops.sim.engine import SimOptions, simulate
from policy import Scheduler
from policy.baselines import make_policy
from policy.client_shares import client_weights
from policy.config import PolicyConfig, policy_preset
from policy.types import RequestHandle

CLIENT_FAIR = replace(PolicyConfig(), client_fairness=1.0)


def _tagged(s: Scheduler, client: str, rate: float) -> RequestHandle:
    h = make_decoder(s, token_rate=rate, delivery_rate=rate, age_ms=0.0)
    s.assign_client(h, client)
    return h


def test_weights_give_each_client_the_same_total_and_untagged_requests_their_own() -> None:
    s = measured_scheduler((decode(4),), CLIENT_FAIR)
    heavy = [_tagged(s, "heavy", 1.0) for _ in range(3)]
    light = _tagged(s, "light", 1.0)
    untagged = _tagged(s, "", 1.0)
    w = client_weights(s._records, 1.0)
    # n = 5 requests, k = 3 clients (the untagged request is its own).
    assert w[light] == pytest.approx(5 / 3)
    assert w[untagged] == pytest.approx(5 / 3)
    assert all(w[h] == pytest.approx(5 / 9) for h in heavy)
    assert sum(w.values()) == pytest.approx(5.0)
    # Exponent 0 is the seed: every weight is one.
    assert set(client_weights(s._records, 0.0).values()) == {1.0}


def test_seed_presets_keep_per_request_prices_and_client_fair_departs() -> None:
    for name in ("balanced", "throughput", "first-token"):
        assert policy_preset(name).client_fairness == 0.0
    ext = policy_preset("client-fair")
    assert ext == replace(policy_preset("balanced"), client_fairness=1.0)
    policy = make_policy("client-fair")
    assert isinstance(policy, Scheduler) and policy.config == ext


def _row_winner(config: PolicyConfig) -> set[str]:
    """One decode row; three heavy decoders with slightly less recent service than one
    light decoder. Returns the client(s) the row goes to."""
    s = measured_scheduler((decode(1),), config)
    clients = {_tagged(s, "heavy", 0.9): "heavy", _tagged(s, "heavy", 0.9): "heavy",
               _tagged(s, "heavy", 0.9): "heavy", _tagged(s, "light", 1.0): "light"}
    plan = s.plan()
    assert plan is not None
    return {clients[lane.handle] for lane in plan.lanes}


def test_the_light_client_wins_a_row_only_with_client_fairness() -> None:
    # The seed prices each request alone: the least served request (heavy) wins.
    assert _row_winner(PolicyConfig()) == {"heavy"}
    # Per client, three heavy requests share one client's weight: light wins.
    assert _row_winner(CLIENT_FAIR) == {"light"}


def test_pricing_views_leave_the_stored_rates_unchanged() -> None:
    s = measured_scheduler((decode(1),), CLIENT_FAIR)
    handles = [_tagged(s, "heavy", 0.9) for _ in range(3)] + [_tagged(s, "light", 1.0)]
    assert s.plan() is not None
    assert [s.request(h).history.token_rate for h in handles] == [0.9, 0.9, 0.9, 1.0]


def _flood() -> list[RequestPlan]:
    """A heavy client sends 24 requests at once, a light one 4 over the next second:
    more resident requests than the 4-row decode batch."""
    heavy = [RequestPlan(index=i, client="heavy", arrival_s=0.0, prompt_tokens=200,
                         output_tokens=60) for i in range(24)]
    light = [RequestPlan(index=24 + i, client="light", arrival_s=0.1 + 0.25 * i,
                         prompt_tokens=60, output_tokens=60) for i in range(4)]
    return heavy + light


def _e2e_p50(policy: object, client: str, plans: list[RequestPlan] | None = None) -> float:
    plans = plans if plans is not None else _flood()
    result = simulate(policy, plans, SyntheticCosts().table(MIXED_CATALOG),  # type: ignore[arg-type]
                      SimOptions(max_resident=64, output_limit=0))
    assert result.unfinished == 0
    return statistics.median(r.finished_s - r.scheduled_s  # type: ignore[operator]
                             for r in result.records if r.client == client)


def test_a_light_client_is_not_starved_by_a_heavy_one() -> None:
    seed = _e2e_p50(make_policy("balanced", catalog=MIXED_CATALOG), "light")
    fair = _e2e_p50(make_policy("client-fair", catalog=MIXED_CATALOG), "light")
    assert fair < seed / 2
    # The heavy client still finishes (every run above asserts no unfinished request)
    # and is not made slower than the seed makes it by more than a quarter.
    heavy_seed = _e2e_p50(make_policy("balanced", catalog=MIXED_CATALOG), "heavy")
    heavy_fair = _e2e_p50(make_policy("client-fair", catalog=MIXED_CATALOG), "heavy")
    assert heavy_fair < 1.25 * heavy_seed


def test_one_client_is_scheduled_exactly_as_the_seed_schedules_it() -> None:
    plans = [replace(p, client="only") for p in _flood()]
    seed = make_policy("balanced", catalog=MIXED_CATALOG)
    fair = make_policy("client-fair", catalog=MIXED_CATALOG)
    costs = SyntheticCosts().table(MIXED_CATALOG)
    a = simulate(seed, plans, costs, SimOptions(max_resident=64, output_limit=0))
    b = simulate(fair, plans, costs, SimOptions(max_resident=64, output_limit=0))
    assert [r.chunk_times_s for r in a.records] == [r.chunk_times_s for r in b.records]
