"""Simulated workloads: arrival processes, length mixes, clients, long-prompt interference.

The arrival and length machinery is the load benchmark's (``ops.loadgen.workload``:
Poisson or gamma-burst arrivals, fixed/uniform/ShareGPT-like synthetic lengths, tagged
clients with unequal demand as independent streams at their share of the rate), so a
simulated scenario and a ``flare bench serve`` run can describe the same traffic. This
module adds long-prompt interference (one long prompt every N seconds over the chat
traffic, from its own client ``long``) and the named scenarios the docs table uses.
Deterministic for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ops.loadgen.workload import (
    ArrivalKind,
    ClientSpec,
    LengthSpec,
    RequestPlan,
    plan_requests,
)

LONG_CLIENT = "long"
CHAT_LENGTHS = LengthSpec(kind="sharegpt", prompt_max=1024, output_max=512)
"""The synthetic ShareGPT-like mix, prompts up to 1024 and answers up to 512 tokens."""


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
    seed: int = 0

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
            "long_output_tokens": self.long_output_tokens, "seed": self.seed,
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
    return tuple(replace(p, index=i) for i, p in enumerate(plans))


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

