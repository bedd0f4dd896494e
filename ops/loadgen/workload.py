"""What the load generator sends and when: arrivals, length mixes, clients, request specs.

Everything here is synchronous and deterministic for a given seed (a ``numpy`` generator
is threaded through explicitly; nothing reads a clock). The open-loop client
(``ops.loadgen.client``) only turns these plans into HTTP traffic.

Arrival processes
    * ``poisson``: exponential inter-arrival gaps with mean ``1 / rate``.
    * ``gamma``: gamma gaps with shape ``burstiness`` and scale ``1 / (rate * burstiness)``,
      so the mean rate is still ``rate``; ``burstiness < 1`` clusters arrivals into bursts,
      ``burstiness == 1`` is Poisson, ``> 1`` is smoother than Poisson (the same
      parameterisation as vLLM's ``--burstiness``).
    * ``rate = inf``: every request at time zero.

Length distributions (target prompt and output lengths, in tokens)
    * ``fixed``: every request the same.
    * ``uniform``: independent integer draws from ``[lo, hi]`` for prompt and output.
    * ``sharegpt``: a *synthetic* mix shaped like ShareGPT chat traffic (no dataset is read):
      prompt lengths log-normal with median 120 tokens and log-sd 1.0, output lengths
      log-normal with median 180 tokens and log-sd 0.9, independent, rounded and clipped to
      ``[min, max]``. The heavy right tails (a few very long prompts and answers among many
      short ones) are what matters for scheduling; the exact moments of the real trace are not
      claimed.

Clients
    Several tagged clients with unequal demand: each client is an independent arrival process
    at ``rate * weight / sum(weights)`` and the streams are merged, so a weight-3 client
    sends three times as many requests as a weight-1 client over the same window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

ArrivalKind = Literal["poisson", "gamma"]
LengthKind = Literal["fixed", "uniform", "sharegpt"]

# Synthetic ShareGPT-like mix (medians and log-space standard deviations, see module doc).
SHAREGPT_PROMPT_MEDIAN = 120.0
SHAREGPT_PROMPT_LOG_SD = 1.0
SHAREGPT_OUTPUT_MEDIAN = 180.0
SHAREGPT_OUTPUT_LOG_SD = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientSpec:
    """One tagged client: its name (sent as the OpenAI ``user`` field) and demand weight."""

    name: str
    weight: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthSpec:
    """A target length distribution; which fields matter depends on ``kind``.

    ``fixed`` uses ``prompt_tokens``/``output_tokens``; ``uniform`` draws from
    ``[prompt_min, prompt_max]`` and ``[output_min, output_max]``; ``sharegpt`` draws the
    synthetic mix and clips it to the same min/max bounds.
    """

    kind: LengthKind = "fixed"
    prompt_tokens: int = 128
    output_tokens: int = 128
    prompt_min: int = 4
    prompt_max: int = 1024
    output_min: int = 1
    output_max: int = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPlan:
    """One planned request: when to send it (seconds after start) and what to ask for."""

    index: int
    client: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    acceptance: float | None = None
    """Simulation only: the probability that the target accepts each drafted token of
    this request's speculative rounds (``ops.sim``); None leaves it to the simulator's
    default. A real server's acceptance is whatever its draft achieves."""


def parse_clients(text: str) -> tuple[ClientSpec, ...]:
    """Parse ``"alice:3,bob:1"`` (weight defaults to 1: ``"alice,bob"``)."""
    clients: list[ClientSpec] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, weight_text = part.partition(":")
        weight = float(weight_text) if weight_text else 1.0
        if not name or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"bad client spec {part!r}: want NAME or NAME:POSITIVE_WEIGHT")
        clients.append(ClientSpec(name=name, weight=weight))
    if not clients:
        raise ValueError("at least one client is needed")
    names = [c.name for c in clients]
    if len(set(names)) != len(names):
        raise ValueError(f"client names must be unique: {names}")
    return tuple(clients)


def arrival_gaps(
    kind: ArrivalKind, rate: float, count: int, rng: np.random.Generator, burstiness: float = 1.0
) -> np.ndarray:
    """``count`` inter-arrival gaps in seconds with mean ``1 / rate`` (zeros if rate is inf)."""
    if count < 0:
        raise ValueError("count must be non-negative")
    if not rate > 0:
        raise ValueError("rate must be positive (use inf for all-at-once)")
    if math.isinf(rate):
        return np.zeros(count)
    if kind == "poisson":
        return rng.exponential(1.0 / rate, size=count)
    if kind == "gamma":
        if not burstiness > 0:
            raise ValueError("burstiness must be positive")
        return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    raise ValueError(f"unknown arrival kind {kind!r}")


def arrival_times(
    kind: ArrivalKind, rate: float, count: int, rng: np.random.Generator, burstiness: float = 1.0
) -> np.ndarray:
    """Send times (seconds from start, non-decreasing); the first request waits one gap."""
    return np.cumsum(arrival_gaps(kind, rate, count, rng, burstiness))


def sample_lengths(spec: LengthSpec, count: int, rng: np.random.Generator) -> np.ndarray:
    """A ``(count, 2)`` integer array of (prompt tokens, output tokens) targets."""
    if spec.kind == "fixed":
        out = np.empty((count, 2), dtype=np.int64)
        out[:, 0] = spec.prompt_tokens
        out[:, 1] = spec.output_tokens
        return out
    if spec.prompt_min < 1 or spec.output_min < 1:
        raise ValueError("length minimums must be at least 1")
    if spec.prompt_max < spec.prompt_min or spec.output_max < spec.output_min:
        raise ValueError("length maximum below minimum")
    if spec.kind == "uniform":
        prompts = rng.integers(spec.prompt_min, spec.prompt_max + 1, size=count)
        outputs = rng.integers(spec.output_min, spec.output_max + 1, size=count)
    elif spec.kind == "sharegpt":
        prompts = np.rint(
            rng.lognormal(math.log(SHAREGPT_PROMPT_MEDIAN), SHAREGPT_PROMPT_LOG_SD, size=count)
        )
        outputs = np.rint(
            rng.lognormal(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_LOG_SD, size=count)
        )
        prompts = np.clip(prompts, spec.prompt_min, spec.prompt_max)
        outputs = np.clip(outputs, spec.output_min, spec.output_max)
    else:
        raise ValueError(f"unknown length kind {spec.kind!r}")
    return np.stack([prompts, outputs], axis=1).astype(np.int64)


def plan_requests(
    *,
    count: int,
    rate: float,
    arrivals: ArrivalKind,
    lengths: LengthSpec,
    clients: Sequence[ClientSpec],
    seed: int,
    burstiness: float = 1.0,
) -> tuple[RequestPlan, ...]:
    """Plan ``count`` requests from the merged per-client arrival processes, by send time.

    Each client draws its own arrival stream at its share of ``rate``; the merged streams are
    cut to the first ``count`` arrivals, so clients' request counts follow their weights.
    With ``rate = inf`` (or for fixed-concurrency runs, which ignore ``arrival_s``) clients
    are interleaved in proportion to their weights.
    """
    if count < 0:
        raise ValueError("count must be non-negative")
    if not clients:
        raise ValueError("at least one client is needed")
    rng = np.random.default_rng(seed)
    total_weight = sum(c.weight for c in clients)
    times: list[float] = []
    owners: list[int] = []
    if math.isinf(rate):
        # Smooth weighted round robin: deterministic and proportional to the weights.
        credit = [0.0] * len(clients)
        for _ in range(count):
            for i, c in enumerate(clients):
                credit[i] += c.weight
            pick = max(range(len(clients)), key=lambda i: credit[i])
            credit[pick] -= total_weight
            owners.append(pick)
            times.append(0.0)
    else:
        for i, c in enumerate(clients):
            # Each client needs at most `count` arrivals for the merge to be exact.
            share = rate * c.weight / total_weight
            for t in arrival_times(arrivals, share, count, rng, burstiness):
                times.append(float(t))
                owners.append(i)
        order = sorted(range(len(times)), key=lambda k: (times[k], owners[k]))[:count]
        times = [times[k] for k in order]
        owners = [owners[k] for k in order]
    sizes = sample_lengths(lengths, count, rng)
    return tuple(
        RequestPlan(
            index=k,
            client=clients[owners[k]].name,
            arrival_s=times[k],
            prompt_tokens=int(sizes[k, 0]),
            output_tokens=int(sizes[k, 1]),
        )
        for k in range(count)
    )
