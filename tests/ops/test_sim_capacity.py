"""Capacity at an SLO (``flare sim-capacity``) and the one running limit of a comparison.

The rate search brackets and bisects a monotone attainment curve; a synthetic case
whose capacity is computable (one 10 ms prefill per request, nearly periodic arrivals)
comes out at that capacity; every configuration runs under the same running limit
(the simulator's admission gate and each baseline's own running limit); attainment is
per client; the command writes the table, the JSON and the Pareto plot, labelled
synthetic (VER-36).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import pytest

from ops import sim_capacity
from ops.loadgen.records import RequestRecord
from ops.loadgen.workload import LengthSpec
from ops.sim.capacity import (
    DEFAULT_CONFIGURATIONS,
    Configuration,
    Setup,
    SloTargets,
    attainment_by_client,
    find_capacity,
    ratio_to_best_baseline,
    simulate_rate,
)
from ops.sim.catalogs import build_catalogs
from ops.sim.costs import CostTable
from ops.sim.engine import SimOptions
from ops.sim.workloads import WorkloadSpec, build_workload
from policy.baselines import BaselinePolicy, make_policy
from policy.descriptors import GraphKind
from policy.types import PolicyError


def test_search_finds_the_threshold_of_a_monotone_curve() -> None:
    search = find_capacity(lambda r: 1.0 if r <= 5.3 else 0.5, start=2.0, steps=6)
    assert 5.3 - 4 / 2 ** 6 <= search.capacity <= 5.3
    rates = [r for r, _ in search.probes]
    assert rates[:3] == [2.0, 4.0, 8.0]  # doubling until the first miss
    down = find_capacity(lambda r: 1.0 if r <= 0.7 else 0.0, start=2.0, steps=3)
    assert 0.5 <= down.capacity <= 0.7
    assert find_capacity(lambda r: 0.0, start=2.0, rate_min=0.5).capacity == 0.0
    assert find_capacity(lambda r: 1.0, start=2.0, rate_max=16.0).capacity == 16.0


def _record(client: str, ttft: float, gaps: tuple[float, ...] = ()) -> RequestRecord:
    times = [1.0 + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(index=0, client=client, scheduled_s=1.0, sent_s=1.0, status="ok",
                         target_prompt_tokens=8, target_output_tokens=len(times),
                         prompt_tokens=8, chunk_times_s=tuple(times),
                         chunk_tokens=(1.0,) * len(times), finished_s=times[-1])


def test_attainment_counts_both_targets_per_client() -> None:
    targets = SloTargets(ttft_s=0.5, tpot_s=0.05)
    records = [_record("a", 0.1, (0.01,)), _record("a", 0.9), _record("b", 0.1, (0.2,)),
               _record("b", 0.2, (0.04, 0.04))]
    assert attainment_by_client(records, targets) == {"a": 0.5, "b": 0.5}
    assert ratio_to_best_baseline({"balanced": 3.0, "fcfs": 2.0, "sarathi-512": 2.5},
                                  "balanced") == pytest.approx(1.2)
    assert ratio_to_best_baseline({"balanced": 3.0, "fcfs": 0.0}, "balanced") is None


def _flat_costs(catalog: tuple, prefill_ms: float) -> CostTable:
    return CostTable({s: (round(prefill_ms * 1e6) if s.kind is not GraphKind.STATE else 1000)
                      for s in catalog}, source="flat")


def test_capacity_of_a_computable_case() -> None:
    """One 64-token prompt and one output token per request, every program 10 ms:
    the device serves 100 requests/s; with 60 nearly periodic arrivals and a 50 ms TTFT
    target, 90 % of them meet it up to about 108/s and none far beyond."""
    catalogs = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=False,
                              draft_depth=0)
    setup = Setup(catalogs=catalogs, costs=_flat_costs(catalogs.ordinary, 10.0), count=60,
                  options=SimOptions(max_resident=4, dispatch_ns=0, output_limit=0),
                  targets=SloTargets(ttft_s=0.05, tpot_s=1.0))
    spec = WorkloadSpec(arrivals="gamma", burstiness=400.0,
                        lengths=LengthSpec(kind="fixed", prompt_tokens=64, output_tokens=1))
    config = Configuration("fcfs", "fcfs")
    search = find_capacity(
        lambda r: simulate_rate(config, spec, r, setup)["attainment"],
        start=16.0, steps=6)
    assert 95.0 <= search.capacity <= 112.0


def _max_running(records: tuple[RequestRecord, ...] | list[dict], ) -> int:
    events = []
    for r in records:
        events += [(r.chunk_times_s[0], 1), (r.finished_s, -1)]
    events.sort(key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("config", DEFAULT_CONFIGURATIONS, ids=lambda c: c.label)
def test_every_configuration_runs_under_the_same_running_limit(config: Configuration) -> None:
    from ops.sim.costs import SyntheticCosts
    from ops.sim.engine import simulate

    catalogs = build_catalogs(max_batch=8, prefill_capacities=(64, 256),
                              mixed_prefill=True, draft_depth=0)
    requests = build_workload(WorkloadSpec(count=24, rate=200.0, lengths=LengthSpec(
        kind="fixed", prompt_tokens=64, output_tokens=12)))
    costs = SyntheticCosts().table(catalogs.ordinary)
    peaks = {}
    for limit in (3, 8):
        planner = make_policy(config.policy, catalog=catalogs.ordinary,
                              token_budget=config.token_budget)
        if isinstance(planner, BaselinePolicy):
            planner.limit_running(limit)
            assert planner.running_limit == limit
        result = simulate(planner, requests, costs, SimOptions(max_resident=limit))
        peaks[limit] = _max_running([r for r in result.records if r.status == "ok"])
    assert peaks[3] <= 3 < peaks[8] <= 8


def test_limit_running_replaces_the_baselines_own_limit() -> None:
    catalog = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=True,
                             draft_depth=2).speculative
    for name in ("fcfs", "sarathi", "vtc", "fixed-spec-1"):
        planner = make_policy(name, catalog=catalog, token_budget=256)
        assert isinstance(planner, BaselinePolicy)
        assert planner.running_limit == 4
        planner.limit_running(32)
        assert planner.running_limit == 32
        with pytest.raises(PolicyError):
            planner.limit_running(0)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sim_capacity.add_arguments(parser)
    return sim_capacity.main(parser.parse_args(argv))


@pytest.mark.slow
def test_command_writes_table_json_and_plot(tmp_path: pathlib.Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap"
    code = run(["--quick", "--scenario", "sharegpt", "tenants", "--configuration",
                "balanced", "fcfs", "sarathi-256", "--cost-model", "roofline-llama3-8b-h100",
                "--max-batch", "8", "--prefill-capacity", "64", "256",
                "--start-rate", "4", "--rate-max", "8", "--output-dir", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "roofline Llama-3-8B on H100 SXM (synthetic)" in printed
    table = (out / "capacity.md").read_text()
    assert table.splitlines()[0] == "| configuration | sharegpt | tenants |"
    assert "| balanced / best baseline |" in table and "sarathi-256" in table
    data = json.loads((out / "capacity.json").read_text())
    assert data["settings"]["synthetic"] is True and data["settings"]["max_running"] == 8
    assert len(data["results"]) == 6 and len(data["pareto"]) == 6
    tenants = next(r for r in data["results"] if r["scenario"] == "tenants")
    at = tenants["at_capacity"]
    clients = set(at["per_client"])  # 12 requests may leave a light tenant out
    assert len(clients) >= 2 and clients <= {"a", "b", "c", "d"}
    assert set(at["attainment_by_client"]) == clients
    assert "1-128" in at["ttft_by_prompt_tokens"] and at["itl_max_s"] is not None
    assert all(p["rate"] > 0 for p in tenants["probes"])
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_command_reports_bad_inputs(capsys: pytest.CaptureFixture[str],
                                    tmp_path: pathlib.Path) -> None:
    assert run(["--ttft", "0", "--output-dir", str(tmp_path)]) == 2
    assert run(["--max-running", "0", "--output-dir", str(tmp_path)]) == 2
    assert run(["--costs", str(tmp_path / "x.json"), "--cost-model", "linear",
                "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--ttft" in err and "--max-running" in err and "not both" in err


def test_variants_change_one_preference_and_are_never_baselines() -> None:
    from ops.sim.capacity import VARIANT_CONFIGURATIONS, is_baseline
    from policy.config import policy_preset

    catalog = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=True,
                             draft_depth=0).ordinary
    variant = next(v for v in VARIANT_CONFIGURATIONS if v.label == "balanced-adapt-5ms")
    planner = variant.make(catalog)
    assert planner.config.adaptation_ms == 5.0
    assert planner.config == dataclasses.replace(policy_preset("balanced"), adaptation_ms=5.0)
    assert Configuration("balanced", "balanced").make(catalog).config == policy_preset("balanced")
    assert not is_baseline("balanced-adapt-5ms") and not is_baseline("balanced")
    assert is_baseline("sarathi-256") and is_baseline("vtc")
    assert ratio_to_best_baseline({"balanced-adapt-5ms": 9.0, "fcfs": 3.0},
                                  "balanced-adapt-5ms") == pytest.approx(3.0)


def test_the_suite_names_existing_scenarios() -> None:
    from ops.sim.capacity import CAPACITY_SCENARIOS
    from ops.sim.workloads import LONG_CLIENT, SCENARIOS

    assert set(CAPACITY_SCENARIOS) == {"sharegpt", "bursty", "long-prompts", "tenants",
                                       "long-outputs"}
    assert set(CAPACITY_SCENARIOS.values()) <= set(SCENARIOS)
    tenants = SCENARIOS[CAPACITY_SCENARIOS["tenants"]]
    assert len({c.weight for c in tenants.clients}) > 1 and len(tenants.clients) >= 3
    long_out = build_workload(dataclasses.replace(
        SCENARIOS[CAPACITY_SCENARIOS["long-outputs"]], count=40))
    assert min(r.output_tokens for r in long_out) >= 256
    long_prompts = build_workload(dataclasses.replace(
        SCENARIOS[CAPACITY_SCENARIOS["long-prompts"]], count=40, rate=4.0))
    assert any(r.client == LONG_CLIENT and r.prompt_tokens == 8192 for r in long_prompts)


def test_table_ratios_only_against_a_baseline_that_ran() -> None:
    from ops.sim.capacity_report import capacity_table

    results = [{"configuration": "balanced", "scenario": "s", "capacity_rps": 3.0},
               {"configuration": "fcfs", "scenario": "s", "capacity_rps": 2.0}]
    table = capacity_table(results, ["s"], ["balanced", "fcfs"])
    assert "| balanced | 3.00 |" in table and "| balanced / best baseline | 1.50x |" in table
    alone = capacity_table(results[:1], ["s"], ["balanced"])
    assert "best baseline" not in alone


def test_a_variant_flag_adds_a_preset_with_fields_replaced() -> None:
    from ops.sim.capacity import is_baseline, parse_variant
    from policy.config import policy_preset

    v = parse_variant("urgent=first-token:prompt_age_price=0.3,adaptation_ms=20")
    assert v.label == "urgent" and v.policy == "first-token"
    catalog = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=True,
                             draft_depth=0).ordinary
    assert v.make(catalog).config == dataclasses.replace(  # type: ignore[attr-defined]
        policy_preset("first-token"), prompt_age_price=0.3, adaptation_ms=20.0)
    assert not is_baseline("urgent") and not is_baseline("first-token")
    spec = parse_variant("s=smooth+spec:decode_age_price=5")
    assert (spec.policy, spec.preset, spec.speculates) == ("spec-adaptive", "smooth", True)
    assert spec.preferences == (("decode_age_price", 5.0),)
    for bad, why in (("x=fcfs:adaptation_ms=5", "preset must be"),
                     ("fcfs=balanced:adaptation_ms=5", "already a configuration"),
                     ("x=balanced:speed=5", "PolicyConfig field"),
                     ("x=balanced:adaptation_ms=fast", "must be a number"),
                     ("x=balanced:adaptation_ms=0", "greater than zero"),
                     ("x=balanced", "expected LABEL"),
                     ("x=fcfs+spec:adaptation_ms=5", "preset must be"),
                     ("x=balanced+specs:adaptation_ms=5", "preset must be")):
        with pytest.raises(ValueError, match=why):
            parse_variant(bad)


def test_speculating_configurations_run_the_seed_presets_on_the_speculative_load() -> None:
    from ops.sim.capacity import (
        is_baseline,
        is_speculative_baseline,
        speculation_configurations,
    )
    from policy.config import policy_preset

    labels = [c.label for c in speculation_configurations(2)]
    assert labels == ["balanced+spec", "throughput+spec", "fixed-spec-1", "fixed-spec-2"]
    catalogs = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=True,
                              draft_depth=2)
    by_label = {c.label: c for c in speculation_configurations(2)}
    spec = by_label["throughput+spec"]
    assert spec.speculates and catalogs.for_policy(spec.policy) == catalogs.speculative
    planner = spec.make(catalogs.speculative)
    assert planner.config == policy_preset("throughput")  # type: ignore[attr-defined]
    assert planner.learns_acceptance
    assert not Configuration("balanced", "balanced").speculates
    from ops.sim.capacity import EXTENSION_SPECULATION_CONFIGURATIONS, speculates

    fair = next(c for c in EXTENSION_SPECULATION_CONFIGURATIONS if c.label == "client-fair+spec")
    assert fair.make(catalogs.speculative).config == policy_preset(  # type: ignore[attr-defined]
        "client-fair")
    assert speculates("client-fair+spec") and speculates("fixed-spec-1")
    assert not speculates("client-fair") and not speculates("sarathi-256")
    assert is_speculative_baseline("fixed-spec-2") and not is_baseline("fixed-spec-2")
    assert not is_speculative_baseline("balanced+spec") and not is_baseline("balanced+spec")


def test_the_setup_acceptance_replaces_the_scenarios() -> None:
    from ops.sim.capacity import speculation_configurations
    from ops.sim.costs import SyntheticCosts

    catalogs = build_catalogs(max_batch=4, prefill_capacities=(64,), mixed_prefill=True,
                              draft_depth=2)
    config = next(c for c in speculation_configurations(2) if c.label == "fixed-spec-2")
    spec = WorkloadSpec(count=8, rate=50.0, lengths=LengthSpec(
        kind="fixed", prompt_tokens=32, output_tokens=24))
    rates = {}
    for acceptance in (0.1, 0.9):
        setup = Setup(catalogs=catalogs, costs=SyntheticCosts().table(catalogs.speculative),
                      options=SimOptions(max_resident=4), count=8,
                      targets=SloTargets(ttft_s=1.0, tpot_s=0.05),
                      acceptance=(acceptance, 0.0))
        rates[acceptance] = simulate_rate(config, spec, 50.0, setup)["speculation"][
            "acceptance_rate"]
    assert rates[0.1] < 0.3 < 0.7 < rates[0.9]


def test_table_ratios_of_speculating_presets_against_the_best_fixed_spec() -> None:
    from ops.sim.capacity_report import capacity_table

    results = [{"configuration": c, "scenario": "s", "capacity_rps": v} for c, v in (
        ("balanced+spec", 6.0), ("fcfs", 2.0), ("fixed-spec-1", 3.0), ("fixed-spec-2", 4.0),
        ("balanced", 2.5))]
    table = capacity_table(results, ["s"], [r["configuration"] for r in results])
    assert "| balanced+spec / best baseline | 3.00x |" in table  # fixed-spec is not counted
    assert "| balanced+spec / best fixed-spec | 1.50x |" in table
    assert "| balanced / best baseline | 1.25x |" in table
    assert "balanced / best fixed-spec" not in table and "fixed-spec-1 / best" not in table


@pytest.mark.slow
def test_with_speculation_adds_the_speculating_configurations(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap"
    code = run(["--quick", "--scenario", "sharegpt", "--configuration", "fcfs",
                "--with-speculation", "--draft-depth", "2", "--acceptance", "0.7",
                "--cost-model", "roofline-llama3-8b-h100", "--max-batch", "8",
                "--prefill-capacity", "64", "256", "--start-rate", "4", "--rate-max", "8",
                "--no-plots", "--output-dir", str(out)])
    assert code == 0
    data = json.loads((out / "capacity.json").read_text())
    assert data["settings"]["speculation"] == {"draft_depth": 2, "acceptance": 0.7,
                                               "acceptance_spread": 0.1,
                                               "speculative_mixed": True}
    ran = {r["configuration"]: r for r in data["results"]}
    assert set(ran) == {"fcfs", "balanced+spec", "throughput+spec", "fixed-spec-1",
                        "fixed-spec-2"}
    assert ran["fcfs"]["at_capacity"]["speculation"]["drafted"] == 0
    drafted = ran["fixed-spec-2"]["at_capacity"]["speculation"]
    assert drafted["drafted"] > 0 and 0.4 < drafted["acceptance_rate"] < 0.95
    assert "| balanced+spec / best fixed-spec |" in capsys.readouterr().out


def test_speculation_flags_report_bad_inputs(capsys: pytest.CaptureFixture[str],
                                             tmp_path: pathlib.Path) -> None:
    assert run(["--with-speculation", "--acceptance", "1.5",
                "--output-dir", str(tmp_path)]) == 2
    assert run(["--configuration", "fixed-spec-3", "--draft-depth", "2",
                "--output-dir", str(tmp_path)]) == 2
    assert run(["--with-speculation", "--draft-depth", "0",
                "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--acceptance" in err and "fixed-spec-3" in err and "--draft-depth >= 1" in err
