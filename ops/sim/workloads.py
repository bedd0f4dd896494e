"""Simulated workloads: arrival processes, length mixes, clients, long-prompt interference,
speculative acceptance rates.

The arrival and length machinery is the load benchmark's (``ops.loadgen.workload``:
Poisson or gamma-burst arrivals, fixed/uniform/ShareGPT-like synthetic lengths, tagged
clients with unequal demand as independent streams at their share of the rate), so a
simulated scenario and a ``flare bench serve`` run can describe the same traffic. This
module adds long-prompt interference (one long prompt every N seconds over the chat
traffic, from its own client ``long``), an acceptance rate per request (the probability
that the target accepts each drafted token: ``acceptance`` for everyone, overridden per
client by ``client_acceptance``, each request's rate spread uniformly by
``acceptance_spread`` and clipped to [0, 1]; the engine draws the accepted prefixes) and
the named scenarios the docs table uses. Deterministic for a given seed: the acceptance
spread has its own generator, so it never changes arrivals or lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ops.loadgen.workload import (
    ArrivalKind,
    ClientSpec,
    LengthSpec,
    RequestPlan,
    plan_requests,
)

LONG_CLIENT = "long"
DEFAULT_ACCEPTANCE = 0.6
"""Per-draft acceptance of a request nobody gave one (a good draft on chat text)."""
ACCEPTANCE_STREAM = 0xACCE
"""Mixed into the seed of the acceptance-spread generator (independent of lengths)."""
CHAT_LENGTHS = LengthSpec(kind="sharegpt", prompt_max=1024, output_max=512)
"""The synthetic ShareGPT-like mix, prompts up to 1024 and answers up to 512 tokens."""
LONG_OUTPUT_LENGTHS = LengthSpec(kind="uniform", prompt_min=32, prompt_max=512,
                                 output_min=256, output_max=1024)
"""Long answers: uniform prompts of 32..512 and answers of 256..1024 tokens."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadSpec:
    """What to send: ``count`` chat requests plus optional periodic long prompts."""

    count: int = 200
    rate: float = 4.0
    arrivals: ArrivalKind = "poisson"
    burstiness: float = 1.0
    lengths: LengthSpec = CHAT_LENGTHS
    clients: tuple[ClientSpec, ...] = (ClientSpec(name="default"),)
    long_prompt_every_s: float | None = None
    long_prompt_tokens: int = 8192
    long_output_tokens: int = 32
    acceptance: float = DEFAULT_ACCEPTANCE
    client_acceptance: tuple[tuple[str, float], ...] = ()
    """Per-client acceptance rates, overriding ``acceptance`` for those clients."""
    acceptance_spread: float = 0.0
    seed: int = 0

    def acceptance_of(self, client: str) -> float:
        return dict(self.client_acceptance).get(client, self.acceptance)

    def to_json(self) -> dict[str, object]:
        return {
            "count": self.count, "rate": self.rate, "arrivals": self.arrivals,
            "burstiness": self.burstiness,
            "lengths": {"kind": self.lengths.kind, "prompt_tokens": self.lengths.prompt_tokens,
                        "output_tokens": self.lengths.output_tokens,
                        "prompt_min": self.lengths.prompt_min,
                        "prompt_max": self.lengths.prompt_max,
                        "output_min": self.lengths.output_min,
                        "output_max": self.lengths.output_max},
            "clients": {c.name: c.weight for c in self.clients},
            "long_prompt_every_s": self.long_prompt_every_s,
            "long_prompt_tokens": self.long_prompt_tokens,
            "long_output_tokens": self.long_output_tokens,
            "acceptance": self.acceptance,
            "client_acceptance": dict(self.client_acceptance),
            "acceptance_spread": self.acceptance_spread, "seed": self.seed,
        }


def build_workload(spec: WorkloadSpec) -> tuple[RequestPlan, ...]:
    """Every request of ``spec`` in arrival order, indexed from 0."""
    chat = plan_requests(count=spec.count, rate=spec.rate, arrivals=spec.arrivals,
                         lengths=spec.lengths, clients=spec.clients, seed=spec.seed,
                         burstiness=spec.burstiness)
    plans = list(chat)
    every = spec.long_prompt_every_s
    if every is not None:
        if not every > 0:
            raise ValueError("long_prompt_every_s must be positive")
        end = max((p.arrival_s for p in chat), default=0.0)
        k = 1
        while k * every <= end:
            plans.append(RequestPlan(index=-1, client=LONG_CLIENT, arrival_s=k * every,
                                     prompt_tokens=spec.long_prompt_tokens,
                                     output_tokens=spec.long_output_tokens))
            k += 1
    plans.sort(key=lambda p: (p.arrival_s, p.index < 0, p.index))
    return tuple(replace(p, index=i, acceptance=a)
                 for i, (p, a) in enumerate(zip(plans, _acceptances(spec, plans), strict=True)))


def _acceptances(spec: WorkloadSpec, plans: list[RequestPlan]) -> list[float]:
    """Each request's per-draft acceptance: its client's rate, spread uniformly by
    ``acceptance_spread`` and clipped to [0, 1]."""
    rates = [spec.acceptance_of(p.client) for p in plans]
    for r in (spec.acceptance, *(a for _, a in spec.client_acceptance)):
        if not (math.isfinite(r) and 0.0 <= r <= 1.0):
            raise ValueError(f"acceptance rates must lie in [0, 1], got {r}")
    spread = spec.acceptance_spread
    if not (math.isfinite(spread) and spread >= 0):
        raise ValueError(f"acceptance spread must be finite and non-negative, got {spread}")
    if spread == 0 or not plans:
        return rates
    jitter = np.random.default_rng([spec.seed, ACCEPTANCE_STREAM]).uniform(
        -spread, spread, size=len(plans))
    return [float(min(1.0, max(0.0, r + j))) for r, j in zip(rates, jitter, strict=True)]


def parse_client_acceptance(text: str) -> tuple[tuple[str, float], ...]:
    """Parse ``"code:0.9,chat:0.4"`` into per-client acceptance rates."""
    out: list[tuple[str, float]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, value = part.partition(":")
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if not name or not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise ValueError(f"bad client acceptance {part!r}: want NAME:RATE with RATE in [0, 1]")
        out.append((name, rate))
    if not out:
        raise ValueError("at least one NAME:RATE is needed")
    return tuple(out)


SCENARIOS: dict[str, WorkloadSpec] = {
    # Short chat at moderate load, an 8192-token prompt every 2 s.
    "interference": WorkloadSpec(count=400, rate=4.0, lengths=CHAT_LENGTHS,
                                 long_prompt_every_s=2.0),
    # Gamma arrivals with burstiness 0.2 (bursts of near-simultaneous requests).
    "bursty": WorkloadSpec(count=400, rate=5.0, arrivals="gamma", burstiness=0.2,
                           lengths=CHAT_LENGTHS),
    # Two clients, one sending three times the other's requests, above capacity.
    "fairness": WorkloadSpec(count=400, rate=9.0, lengths=CHAT_LENGTHS,
                             clients=(ClientSpec(name="heavy", weight=3.0),
                                      ClientSpec(name="light", weight=1.0))),
    # Plain Poisson chat traffic.
    "poisson": WorkloadSpec(count=400, rate=4.0, lengths=CHAT_LENGTHS),
    # Four tenants with unequal demand (4:2:1:1 of the requests).
    "tenants": WorkloadSpec(count=400, rate=4.0, lengths=CHAT_LENGTHS,
                            clients=(ClientSpec(name="a", weight=4.0),
                                     ClientSpec(name="b", weight=2.0),
                                     ClientSpec(name="c", weight=1.0),
                                     ClientSpec(name="d", weight=1.0))),
    # Long answers: prompts of 32..512 tokens, answers of 256..1024, uniform.
    "long-outputs": WorkloadSpec(count=400, rate=2.0, lengths=LONG_OUTPUT_LENGTHS),
    # Speculation that pays for some requests and not others: a client whose text the
    # draft predicts well (code, 0.85 per draft) and one it does not (chat, 0.3),
    # equal demand, each request's rate spread by +-0.1.
    "acceptance": WorkloadSpec(count=400, rate=6.0, lengths=CHAT_LENGTHS,
                               clients=(ClientSpec(name="code"), ClientSpec(name="chat")),
                               client_acceptance=(("code", 0.85), ("chat", 0.3)),
                               acceptance_spread=0.1),
}
"""The named scenarios of ``flare sim --scenario`` and ``docs/simulator.md``."""


def scenario(name: str, **overrides: object) -> WorkloadSpec:
    """A named scenario with fields replaced (``None`` values leave the preset's)."""
    try:
        spec = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; expected one of: "
                         f"{', '.join(SCENARIOS)}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    return replace(spec, **changes)  # type: ignore[arg-type]

