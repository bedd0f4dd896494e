"""Simulated speculative rounds: acceptance draws, accounting, workloads, catalogs.

Covers requests with different acceptance rates in the simulator; fixed-spec-k
baselines against the seed's speculative scheduler: the accepted prefix of a round is
the leading run of accepted draft positions from the request's output position (common
random numbers, hand-computed here), a lane emits its accepted prefix plus one token cut
at the simulated EOS, rounds queue behind rounds (QUEUE-11), per-client acceptance with a
seeded spread that leaves arrivals and lengths alone, and each policy runs on the catalog
its server would load (as ``actors.catalog_setup.served_shapes`` builds it; MIX-7, LRN-10).
"""

from __future__ import annotations

import numpy as np
import pytest

from ops.loadgen.workload import ClientSpec, RequestPlan
from ops.sim.catalogs import build_catalogs
from ops.sim.costs import CostTable, SyntheticCosts
from ops.sim.engine import ACCEPTANCE_DRAWS, SimOptions, acceptance_runs, simulate
from ops.sim.workloads import WorkloadSpec, build_workload, parse_client_acceptance, scenario
from policy.baselines import make_policy
from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.learning import round_observations

MS = 1_000_000
PREFILL_64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)


def spec(b: int, w: int) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=b * w,
                      binding=TargetBinding.QUERY_LENGTH)


CATALOG = (PREFILL_64, spec(1, 1), spec(1, 2), spec(1, 3))
COSTS = CostTable({PREFILL_64: 4 * MS, spec(1, 1): 5 * MS, spec(1, 2): 6 * MS,
                   spec(1, 3): 10 * MS}, source="test")


def request(output: int, acceptance: float, index: int = 0) -> RequestPlan:
    return RequestPlan(index=index, client="c", arrival_s=0.0, prompt_tokens=10,
                       output_tokens=output, acceptance=acceptance)


def test_acceptance_runs_by_hand() -> None:
    """runs[j]: consecutive accepted positions from j; the draws are the request's own
    seeded uniforms; extending the horizon keeps every earlier draw."""
    u = np.random.default_rng([3, 5, ACCEPTANCE_DRAWS]).random(12)
    ok = u < 0.5
    expected = []
    for j in range(12):
        n = 0
        while j + n < 12 and ok[j + n]:
            n += 1
        expected.append(n)
    assert acceptance_runs(3, 5, 0.5, 12).tolist() == expected
    assert acceptance_runs(3, 5, 0.5, 40)[:12].tolist()[:6] == expected[:6]
    assert acceptance_runs(0, 0, 1.0, 4).tolist() == [4, 3, 2, 1]
    assert acceptance_runs(0, 0, 0.0, 4).tolist() == [0, 0, 0, 0]


def test_full_acceptance_round_accounting() -> None:
    """fixed-spec-2, acceptance 1, target 6 tokens, 50 us dispatch gap:
    prefill 0.05..4.05 ms (token 1); round A (3 rows) 4.10..14.10 emits 3; round B,
    queued behind A at 4.05, emits min(3, 6 - 4) = 2 with the EOS at 24.10; round C,
    queued behind B when A completed, runs 24.10..34.10 and is discarded."""
    result = simulate(make_policy("fixed-spec-2", catalog=CATALOG), [request(6, 1.0)],
                      COSTS, SimOptions())
    (rec,) = result.records
    assert rec.status == "ok" and rec.finish_reason == "stop"
    assert rec.chunk_times_s == pytest.approx((0.00405, 0.0141, 0.0241), abs=1e-12)
    assert rec.chunk_tokens == (1.0, 3.0, 2.0)
    assert result.frames == {"prefill": 1, "speculative": 3}
    assert result.makespan_s == pytest.approx(0.0341)
    assert result.speculation == {"rounds": 3, "lanes": 3, "drafted": 6, "accepted": 6}


def test_zero_acceptance_emits_one_token_per_round() -> None:
    result = simulate(make_policy("fixed-spec-2", catalog=CATALOG), [request(4, 0.0)],
                      COSTS, SimOptions(output_limit=0))
    (rec,) = result.records
    assert rec.chunk_tokens == (1.0, 1.0, 1.0, 1.0) and rec.finish_reason == "length"
    assert result.speculation["accepted"] == 0
    # the host lengths shrink with the room left: 3, then 2 (queued), then 1
    assert result.speculation["drafted"] == 2 + 1 + 0


def test_partial_acceptance_follows_the_position_draws() -> None:
    """fixed-spec-1 (one draft per round): the round at output position p emits 2 tokens
    exactly when the draw at p accepts; the bursts follow the request's uniforms."""
    target, a = 30, 0.5
    result = simulate(make_policy("fixed-spec-1", catalog=CATALOG),
                      [request(target, a, index=7)], COSTS, SimOptions(seed=11))
    ok = np.random.default_rng([11, 7, ACCEPTANCE_DRAWS]).random(200) < a
    bursts, position = [1.0], 1
    while position < target:
        emitted = min(2 if ok[position] else 1, target - position)
        bursts.append(float(emitted))
        position += emitted
    (rec,) = result.records
    assert list(rec.chunk_tokens) == bursts


def test_workload_acceptance_per_client_with_a_seeded_spread() -> None:
    base = WorkloadSpec(count=60, rate=10.0, seed=2,
                        clients=(ClientSpec(name="code"), ClientSpec(name="chat")),
                        client_acceptance=(("code", 0.9),), acceptance=0.3)
    plain = build_workload(base)
    assert {(p.client, p.acceptance) for p in plain} == {("code", 0.9), ("chat", 0.3)}
    spread = build_workload(WorkloadSpec(**{**_fields(base), "acceptance_spread": 0.2}))
    assert [(p.arrival_s, p.prompt_tokens, p.output_tokens) for p in spread] == \
        [(p.arrival_s, p.prompt_tokens, p.output_tokens) for p in plain]
    for p in spread:
        centre = 0.9 if p.client == "code" else 0.3
        assert max(centre - 0.2, 0.0) <= p.acceptance <= min(centre + 0.2, 1.0)
    chat = [p.acceptance for p in spread if p.client == "chat"]  # never clipped
    assert len(set(chat)) == len(chat) > 10
    assert any(p.acceptance == 1.0 for p in spread)  # code: 0.9 + up to 0.2, clipped
    assert build_workload(WorkloadSpec(**{**_fields(base), "acceptance_spread": 0.2})) == spread
    assert parse_client_acceptance("a:0.5, b:1") == (("a", 0.5), ("b", 1.0))
    for bad in ("a:1.5", "a", ":0.3"):
        with pytest.raises(ValueError):
            parse_client_acceptance(bad)
    with pytest.raises(ValueError, match="acceptance"):
        build_workload(WorkloadSpec(count=2, acceptance=2.0))


def _fields(spec: WorkloadSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def test_each_policy_gets_the_catalog_its_server_loads() -> None:
    """Non-speculative policies: the ordinary catalog; spec-adaptive and fixed-spec-K: the
    speculative load; spec-fixed: its fixed-width subset, exactly as the runtime serves
    them (``actors.catalog_setup.served_shapes``)."""
    import pathlib

    from actors.catalog_setup import served_shapes
    from actors.config import RuntimeConfig
    from gpu.catalog import CatalogFlags, build_catalog

    cats = build_catalogs(max_batch=8, prefill_capacities=(64, 256), mixed_prefill=True,
                          draft_depth=3)
    load = build_catalog(CatalogFlags(max_batch=8, prefill_capacities=(64, 256),
                                      mixed_prefill=True, family_supports_mixed=True,
                                      draft_depth=3,
                                      state_operations=RuntimeConfig().state_operations)).shapes
    for mode, mine in (("adaptive", cats.speculative), ("fixed", cats.fixed_width)):
        config = RuntimeConfig(model_dir=pathlib.Path("."), speculation=mode)  # type: ignore[arg-type]
        assert mine == served_shapes(load, config)
    # MIX-6, MIX-7, MIX-43: the adaptive load keeps the wider mixed programs; fixed width
    # keeps only mixed programs of width D + 1
    assert any(s.kind is GraphKind.MIXED and s.token_capacity > 1 for s in cats.speculative)
    assert {s.token_capacity for s in cats.fixed_width if s.kind is GraphKind.MIXED} == {4}
    assert not any(s.kind is GraphKind.SPECULATIVE for s in cats.ordinary)
    assert cats.for_policy("sarathi") == cats.ordinary == cats.for_policy("balanced")
    assert cats.for_policy("fixed-spec-2") == cats.speculative == cats.for_policy("spec-adaptive")
    assert cats.for_policy("spec-fixed") == cats.fixed_width
    assert set(cats.union(["sarathi", "spec-fixed"])) == set(cats.ordinary) | set(cats.fixed_width)


@pytest.mark.parametrize("policy", ["spec-adaptive", "spec-fixed", "fixed-spec-3"])
def test_speculative_policies_finish_every_request(policy: str) -> None:
    """A small acceptance scenario on the synthetic speculative load: every request
    finishes with exactly its target tokens, and high-acceptance requests get bursts."""
    cats = build_catalogs(max_batch=4, prefill_capacities=(64, 256), mixed_prefill=True)
    requests = build_workload(scenario("acceptance", count=16, rate=20.0, seed=1))
    result = simulate(make_policy(policy, catalog=cats.for_policy(policy)), requests,
                      SyntheticCosts().table(cats.for_policy(policy)), SimOptions(seed=1))
    assert all(r.status == "ok" for r in result.records)
    assert [r.output_tokens for r in result.records] == [p.output_tokens for p in requests]
    # rounds run in separate speculative programs or as the speculative decode rows of
    # wider mixed programs (MIX-43; spec-fixed's load serves both at width D + 1)
    assert result.speculation["drafted"] > 0 and result.speculation["accepted"] > 0
    code = [r for r in result.records if r.client == "code"]
    assert any(max(r.chunk_tokens) > 1 for r in code)


class _Recorder:
    """Wraps a speculating ``Scheduler``: records the offered depths it learns from the
    rounds it completes and the counterfactual depth-one observations it takes."""

    def __init__(self, scheduler: object) -> None:
        self.offered: list[tuple[int, int]] = []
        """(offered depths, the lane's drafts) per round lane."""
        self.width_one: list[tuple[int, int]] = []
        complete, observe = scheduler.complete, scheduler.observe_counterfactual
        commit = scheduler.commit
        depth_beyond = scheduler.speculation.settings.depth_beyond
        plans = {}

        def record_commit(plan, fence):  # type: ignore[no-untyped-def]
            plans[fence] = plan
            return commit(plan, fence)

        def record_complete(fence, records, timing, *, round=None):  # type: ignore[no-untyped-def]
            ceilings = {lane.handle: lane.token_ceiling for lane in plans[fence].lanes}
            if round is not None:
                survival, offered = round_observations(round.lanes,
                                                       depth_beyond=depth_beyond)
                for h, n in offered.items():
                    self.offered.append((n, ceilings[h] - 1))
                    assert len(survival[h]) == n
            return complete(fence, records, timing, round=round)

        scheduler.commit = record_commit  # type: ignore[attr-defined]

        def observe_counterfactual(handle, *, offered, accepted, terminated, survival=None):  # type: ignore[no-untyped-def]
            self.width_one.append((offered, accepted))
            return observe(handle, offered=offered, accepted=accepted,
                           terminated=terminated, survival=survival)

        scheduler.complete = record_complete  # type: ignore[attr-defined]
        scheduler.observe_counterfactual = observe_counterfactual  # type: ignore[attr-defined]


@pytest.mark.parametrize("enabled", [True, False])
def test_draft_counterfactuals_observe_one_depth_more_and_width_one_steps(
        enabled: bool) -> None:
    """``SimOptions.draft_counterfactuals``: as ``flare run`` does for the learned draft,
    adaptive rounds of ``D`` drafts complete as ``D + 1`` offered depths and width-one
    steps observe a depth-one round; off (the seed's ACC-9), rounds offer their ``D``
    and width-one steps observe nothing. Fixed-width mode never learns this way."""
    # a request whose drafts hold runs rounds; one whose drafts fail runs W = 1 steps
    requests = [request(40, 0.9, index=0), request(60, 0.05, index=1)]
    adaptive = make_policy("spec-adaptive", catalog=CATALOG)
    seen = _Recorder(adaptive)
    simulate(adaptive, requests, COSTS, SimOptions(draft_counterfactuals=enabled,
                                                   max_resident=1))
    if enabled:
        assert seen.offered and all(n == drafts + 1 for n, drafts in seen.offered)
        assert seen.width_one and {o for o, _ in seen.width_one} == {1}
    else:
        assert not seen.offered and not seen.width_one
    fixed = make_policy("spec-fixed", catalog=CATALOG)
    fixed_seen = _Recorder(fixed)
    simulate(fixed, requests, COSTS, SimOptions(draft_counterfactuals=True, max_resident=1))
    assert not fixed_seen.offered and not fixed_seen.width_one
