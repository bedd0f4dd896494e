"""Capacity at an SLO: the highest arrival rate a scheduling configuration serves well.

A configuration (a policy name and, for the budgeted baselines, a token budget) meets
the SLO at a rate when, in a simulated run of the scenario at that rate, at least
``attainment`` of every client's requests finished with TTFT <= ``ttft_s`` and TPOT <=
``tpot_s`` (a request with one output token has no TPOT; a refused or unfinished
request misses). Per client, so a tenant starved by a heavy one, or the long prompts
of the ``interference`` scenario, make the run miss even when the overall fraction
would pass; with one client it is the plain fraction.

``find_capacity`` searches the rate: from ``start`` it doubles while the SLO is met (or
halves while it is not), then bisects the bracket ``steps`` times; the capacity is the
highest rate seen to meet it (0 when none did down to ``rate_min``). Attainment is
assumed to fall with the rate, as it does for every policy here; a probe list in the
output shows every rate tried. Every configuration runs the same requests at the same
rate (the workload's seed fixes arrivals and lengths), the same running limit and the
same cost table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ops.loadgen.metrics import distribution
from ops.loadgen.records import RequestRecord
from ops.sim.catalogs import Catalogs
from ops.sim.costs import CostTable
from ops.sim.engine import SimOptions, simulate
from ops.sim.runs import per_client_latency
from ops.sim.workloads import SCENARIOS, WorkloadSpec, build_workload
from policy.baselines import BaselinePolicy, make_policy
from policy.baselines.factory import (
    EXTENSION_PRESETS,
    FIXED_SPEC_POLICIES,
    speculative_policy,
)
from policy.baselines.fixed_spec import fixed_spec_depth
from policy.config import policy_preset
from policy.descriptors import GraphShape
from policy.protocol import SchedulingPolicy


@dataclass(frozen=True, slots=True)
class Configuration:
    """One scheduling configuration of the comparison."""

    label: str
    policy: str
    token_budget: int = 512
    preferences: tuple[tuple[str, float], ...] = ()
    """``PolicyConfig`` fields replaced in the seed preset ``policy`` (a variant the
    comparison measures; empty: the preset as it is)."""
    preset: str = ""
    """For the speculating seed scheduler (``spec-adaptive``): the preset it runs with
    (what ``flare run --scheduler-policy P --speculation adaptive`` runs)."""

    def make(self, catalog: Sequence[GraphShape]) -> SchedulingPolicy:
        config = None
        if self.preferences or self.preset:
            config = replace(policy_preset(self.preset or self.policy),
                             **dict(self.preferences))
        return make_policy(self.policy, config, catalog=catalog,
                           token_budget=self.token_budget)

    @property
    def speculates(self) -> bool:
        """Whether it runs on a speculative load (a draft model beside the target)."""
        return speculative_policy(self.policy)


SARATHI_BUDGETS = (256, 512, 1024, 2048)
DEFAULT_CONFIGURATIONS = (
    Configuration("balanced", "balanced"),
    Configuration("throughput", "throughput"),
    Configuration("fcfs", "fcfs"),
    Configuration("vtc", "vtc"),
    *(Configuration(f"sarathi-{b}", "sarathi", b) for b in SARATHI_BUDGETS),
)
SEED_LABELS = ("balanced", "throughput")
"""The seed's presets; every other configuration is a baseline."""
VARIANT_CONFIGURATIONS = (
    Configuration("balanced-adapt-5ms", "balanced", preferences=(("adaptation_ms", 5.0),)),
    Configuration("balanced-adapt-20ms", "balanced", preferences=(("adaptation_ms", 20.0),)),
    Configuration("balanced-retire-10k", "balanced",
                  preferences=(("terminal_value", 10_000.0),)),
    *(Configuration(name, name) for name in EXTENSION_PRESETS),
)
"""Opt-in measurements of the seed preset with one preference changed (not run by
default, never counted as the seed or as a baseline)."""
SPECULATION_CONFIGURATIONS = (
    Configuration("balanced+spec", "spec-adaptive", preset="balanced"),
    Configuration("throughput+spec", "spec-adaptive", preset="throughput"),
    *(Configuration(name, name) for name in FIXED_SPEC_POLICIES),
)
"""``--with-speculation``: the seed's presets with adaptive speculation (SEL-1..SEL-13)
and the baseline that speculates every decode at a fixed depth K (``fixed-spec-K``,
chunked prefill at the same budget as sarathi's default), all on the speculative load
of one draft depth."""
EXTENSION_SPECULATION_CONFIGURATIONS = (
    *(Configuration(f"{name}+spec", "spec-adaptive", preset=name)
      for name in EXTENSION_PRESETS),
)
"""Opt-in (``--configuration``): flare's extension presets with adaptive speculation."""
CONFIGURATIONS = (DEFAULT_CONFIGURATIONS + VARIANT_CONFIGURATIONS + SPECULATION_CONFIGURATIONS
                  + EXTENSION_SPECULATION_CONFIGURATIONS)

CAPACITY_SCENARIOS: dict[str, str] = {
    "sharegpt": "poisson",
    "bursty": "bursty",
    "long-prompts": "interference",
    "tenants": "tenants",
    "long-outputs": "long-outputs",
}
"""The capacity suite: its name for each ``ops.sim.workloads`` scenario it sweeps."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SloTargets:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """What every probe shares: catalogs, costs, simulator options, request count."""

    catalogs: Catalogs
    costs: CostTable
    options: SimOptions
    count: int
    targets: SloTargets
    acceptance: tuple[float, float] | None = None
    """(acceptance, spread) of every request's drafts (``WorkloadSpec.acceptance`` and
    ``acceptance_spread``) in place of the scenario's; None keeps the scenario's."""


def attainment_by_client(records: Sequence[RequestRecord],
                         targets: SloTargets) -> dict[str, float]:
    """Per client, the fraction of its requests that met both targets."""
    met: dict[str, list[int]] = {}
    for r in records:
        ttft, tpot = r.ttft_s, r.tpot_s
        ok = (r.status == "ok" and ttft is not None and ttft <= targets.ttft_s
              and (tpot is None or tpot <= targets.tpot_s))
        counts = met.setdefault(r.client, [0, 0])
        counts[0] += ok
        counts[1] += 1
    return {c: hit / n for c, (hit, n) in sorted(met.items())}


PROMPT_BUCKETS = ((1, 128), (129, 512), (513, 1024), (1025, 1 << 30))
"""Prompt-length buckets of the TTFT breakdown (inclusive bounds)."""


def run_metrics(records: Sequence[RequestRecord], targets: SloTargets) -> dict[str, Any]:
    """What the capacity report keeps of one run: TTFT/TPOT/ITL distributions, TTFT by
    prompt length, the largest gap between streamed chunks, per-client latency and
    attainment."""
    ok = [r for r in records if r.status == "ok"]
    gaps = [g for r in ok for g in r.chunk_gaps_s()]
    buckets = {}
    for lo, hi in PROMPT_BUCKETS:
        name = f"{lo}-{hi}" if hi < 1 << 30 else f">{lo - 1}"
        buckets[name] = distribution(t for r in ok if lo <= r.target_prompt_tokens <= hi
                                     and (t := r.ttft_s) is not None)
    by_client = attainment_by_client(records, targets)
    return {
        "requests": len(records), "ok": len(ok),
        "attainment": min(by_client.values(), default=0.0),
        "attainment_by_client": by_client,
        "ttft_s": distribution(t for r in ok if (t := r.ttft_s) is not None),
        "tpot_s": distribution(t for r in ok if (t := r.tpot_s) is not None),
        "itl_s": distribution(gaps),
        "itl_max_s": max(gaps, default=None),
        "ttft_by_prompt_tokens": buckets,
        "per_client": per_client_latency(records),
        "sent_by_client": {c: sum(r.client == c for r in records)
                           for c in sorted({r.client for r in records})},
    }


def simulate_rate(config: Configuration, spec: WorkloadSpec, rate: float,
                  setup: Setup) -> dict[str, Any]:
    """One run of ``config`` on ``spec`` at ``rate`` requests per second: its metrics."""
    spec = replace(spec, rate=rate, count=setup.count)
    if setup.acceptance is not None:
        spec = replace(spec, acceptance=setup.acceptance[0],
                       acceptance_spread=setup.acceptance[1])
    requests = build_workload(spec)
    catalog = setup.catalogs.for_policy(config.policy)
    planner = config.make(catalog)
    if isinstance(planner, BaselinePolicy):
        planner.limit_running(setup.options.max_resident)
    result = simulate(planner, requests, setup.costs, setup.options)
    metrics = run_metrics(result.records, setup.targets)
    metrics["rate"] = rate
    metrics["policy"] = config.policy
    metrics["simulation_cpu_s"] = result.cpu_s
    metrics["slots"] = result.slots
    metrics["speculation"] = result.stats_json()["speculation"]
    return metrics


@dataclass(slots=True)
class Search:
    """The rates tried and whether each met the SLO."""

    probes: list[tuple[float, float]] = field(default_factory=list)
    """(rate, attainment) in the order tried."""

    @property
    def capacity(self) -> float:
        return max((r for r, _ in self.passing), default=0.0)

    passing: list[tuple[float, float]] = field(default_factory=list)


def find_capacity(attainment_at: Callable[[float], float], *, target: float = 0.9,
                  start: float = 2.0, rate_min: float = 0.125, rate_max: float = 256.0,
                  steps: int = 4) -> Search:
    """The highest rate whose attainment reaches ``target`` (module docstring)."""
    search = Search()

    def ok(rate: float) -> bool:
        a = attainment_at(rate)
        search.probes.append((rate, a))
        if a >= target:
            search.passing.append((rate, a))
            return True
        return False

    rate = start
    if ok(rate):
        lo, hi = rate, None
        while hi is None:
            if rate * 2 > rate_max:
                return search
            rate *= 2
            if ok(rate):
                lo = rate
            else:
                hi = rate
    else:
        lo, hi = None, rate
        while lo is None:
            if rate / 2 < rate_min:
                return search
            rate /= 2
            if ok(rate):
                lo = rate
            else:
                hi = rate
    for _ in range(steps):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return search


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSettings:
    start: float = 2.0
    rate_min: float = 0.125
    rate_max: float = 256.0
    steps: int = 4


def capacity_of(config: Configuration, scenario_name: str, setup: Setup,
                settings: SearchSettings) -> dict[str, Any]:
    """Search one configuration's capacity on one scenario of the suite; the metrics of
    the run at the capacity (or at the lowest rate tried when none met the SLO)."""
    spec = SCENARIOS[CAPACITY_SCENARIOS[scenario_name]]
    runs: dict[float, dict[str, Any]] = {}

    def attainment_at(rate: float) -> float:
        runs[rate] = simulate_rate(config, spec, rate, setup)
        return float(runs[rate]["attainment"])

    search = find_capacity(attainment_at, target=setup.targets.attainment,
                           start=settings.start, rate_min=settings.rate_min,
                           rate_max=settings.rate_max, steps=settings.steps)
    at = search.capacity or min(runs)
    return {"configuration": config.label, "policy": config.policy,
            "token_budget": config.token_budget, "scenario": scenario_name,
            "capacity_rps": search.capacity,
            "probes": [{"rate": r, "attainment": a} for r, a in search.probes],
            "at_capacity": runs[at],
            "simulation_cpu_s": sum(m["simulation_cpu_s"] for m in runs.values())}


BASELINE_LABELS = frozenset(c.label for c in DEFAULT_CONFIGURATIONS
                            if c.label not in SEED_LABELS)
"""fcfs, vtc and the sarathi budgets: the configurations the seed is compared against."""
SPECULATIVE_BASELINE_LABELS = frozenset(FIXED_SPEC_POLICIES)
"""The fixed-depth speculation baselines (``--with-speculation``): the seed's speculating
presets are also compared against the best of these."""


def is_baseline(label: str) -> bool:
    """Whether ``label`` names a baseline configuration without speculation (not a seed
    preset, a flare preset, a variant or a speculating configuration)."""
    return label in BASELINE_LABELS


def is_speculative_baseline(label: str) -> bool:
    return label in SPECULATIVE_BASELINE_LABELS


def speculates(label: str) -> bool:
    """Whether ``label`` names a configuration that speculates."""
    return any(c.label == label and c.speculates for c in CONFIGURATIONS)


def speculation_configurations(draft_depth: int) -> list[Configuration]:
    """The ``--with-speculation`` configurations a load of ``draft_depth`` serves (the
    fixed-depth baselines up to that depth)."""
    return [c for c in SPECULATION_CONFIGURATIONS
            if (fixed_spec_depth(c.policy) or 0) <= draft_depth]


def parse_variant(text: str) -> Configuration:
    """``LABEL=PRESET:FIELD=VALUE[,FIELD=VALUE...]`` (``--variant``): the seed's
    ``Scheduler`` under preset ``PRESET`` with ``PolicyConfig`` fields replaced, under a
    label of its own; never a baseline. ``PRESET+spec`` runs it with adaptive
    speculation (``spec-adaptive``, as the ``+spec`` configurations). ``ValueError``
    names what is wrong."""
    from dataclasses import fields

    from policy.baselines import PRESET_POLICIES
    from policy.config import PolicyConfig

    label, sep, rest = text.partition("=")
    preset, colon, assignments = rest.partition(":")
    if not sep or not label or not colon:
        raise ValueError(f"--variant {text!r}: expected LABEL=PRESET:FIELD=VALUE,...")
    if any(c.label == label for c in CONFIGURATIONS):
        raise ValueError(f"--variant {text!r}: label {label!r} is already a configuration")
    base, spec, trailing = preset.partition("+spec")
    if base not in PRESET_POLICIES or trailing:
        raise ValueError(f"--variant {text!r}: preset must be one of "
                         f"{', '.join(PRESET_POLICIES)}, optionally followed by +spec")
    known = {f.name: f.type for f in fields(PolicyConfig)}
    prefs: list[tuple[str, float]] = []
    for item in assignments.split(","):
        name, eq, value = item.partition("=")
        if not eq or name not in known:
            raise ValueError(f"--variant {text!r}: {item!r} is not FIELD=VALUE with a "
                             "PolicyConfig field")
        try:
            number = int(value) if name == "estimate_ttl_ns" else float(value)
        except ValueError:
            raise ValueError(f"--variant {text!r}: {name} must be a number") from None
        prefs.append((name, number))
    config = (Configuration(label, "spec-adaptive", preset=base, preferences=tuple(prefs))
              if spec else Configuration(label, base, preferences=tuple(prefs)))
    replace(policy_preset(base), **dict(prefs))  # PolicyConfigError (a ValueError)
    return config


def ratio_to_best_baseline(capacities: Mapping[str, float], label: str, *,
                           baseline: Callable[[str], bool] = is_baseline) -> float | None:
    """``label``'s capacity over the best ``baseline``'s (None when no such baseline
    served any rate, or ``label`` is missing)."""
    best = max((c for name, c in capacities.items() if baseline(name)), default=0.0)
    if label not in capacities or best <= 0:
        return None
    return capacities[label] / best
