"""Scheduling preferences: ``PolicyConfig``, its presets and its validation.

Seed section: *Policy preferences* (POL-1..24). The coefficients are preferences, a
throughput/cadence trade-off; no code path turns any of them into a deadline, timeout or
latency bound (POL-11). Setting a fairness or age coefficient to zero removes that
preference (POL-12); with both fairness and age at zero flare does not claim starvation
freedom (POL-13).

Symbol binding (OPEN-2, see ``docs/scheduling-utility.md``): f = ``token_fairness``,
beta = ``output_token_value``, g = ``delivery_fairness``, c_i = ``decode_age_price`` for
decoding rows and ``terminal_age_price`` for terminal rows.

Validation (decisions for OPEN-5 and OPEN-29):

- every field is a real number (``bool`` is refused), finite and non-negative, not only
  the terminal overrides: a negative or infinite coefficient would turn a price into a
  reward for starvation or make every score infinite;
- ``adaptive_verification_alpha`` > 0 (POL-23), ``adaptation_ms`` > 0 (it is a time
  constant we divide by) and ``estimate_ttl_ns`` > 0 and an ``int`` (a zero freshness
  interval would make every measured graph permanently stale);
- ``checkpoint_extra_work_fraction`` (OPEN-5) is a PolicyConfig field, so that one value
  carries every scheduling preference; the CLI exposes it as a flag later.

Errors are ``PolicyConfigError`` (a ``ValueError``) whose message names the field, the
rule and the rejected value. Whether ``configure_policy`` is refused after the first
admission is the ``Scheduler``'s decision (policy/scheduler.py), not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

__all__ = [
    "POLICY_PRESETS",
    "PolicyConfig",
    "PolicyConfigError",
    "policy_preset",
]


class PolicyConfigError(ValueError):
    """Raised when a PolicyConfig field, a preset name or an override is invalid.

    The message names the offending field (or preset) and the rule it broke.
    """


_POSITIVE_FIELDS = frozenset({"adaptive_verification_alpha", "adaptation_ms", "estimate_ttl_ns"})
"""Fields that must be strictly positive, not merely non-negative."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """The scheduler's preference coefficients, with the seed's defaults (POL-2..10)."""

    output_token_value: float = 64.0
    """beta: prompt-value units per output token (POL-2)."""
    token_fairness: float = 16.0
    """f: token-rate log-utility coefficient, value/ms (POL-3)."""
    delivery_fairness: float = 4.0
    """g: delivery-rate log-utility coefficient, value/ms (POL-4)."""
    decode_age_price: float = 0.1
    """c_i for decoding rows: linear output-age cost, value/ms^2 (POL-5)."""
    terminal_value: float = 256.0
    """Value per terminal retirement, in prompt-token units (POL-6)."""
    terminal_age_price: float = 1.0
    """c_i for terminal rows: linear terminal-wait cost, value/ms^2 (POL-7)."""
    adaptation_ms: float = 100.0
    """Time constant of the smoothed service rates, ms (POL-8)."""
    estimate_ttl_ns: int = 30_000_000_000
    """Timing freshness interval (POL-9, DUR-10)."""
    adaptive_verification_alpha: float = 1.0
    """Exponent on prefix-survival estimates in speculative scores (POL-10, ACC-3)."""
    checkpoint_extra_work_fraction: float = 0.05
    """Extra work a complete-state checkpoint may add (QUEUE-20/21, OPEN-5)."""
    prompt_age_price: float = 0.0
    """flare's first-token urgency u, value per prompt token per ms waited since the
    request arrived (a wait for a running slot included), added to the prefill token
    price (``1 + f/x + u*A``). Not a seed preference: 0 (every seed preset) is the
    seed's price (SEL-5)."""
    finish_age_price: float = 0.0
    """flare's finish urgency v, value per prompt token per ms waited: the chunk that
    finishes a prompt is also credited ``v*A`` for each prompt token before it, the work
    that its first output turns into a delivery (U-14,
    ``policy.prompt_prices.first_output_values``). Not a seed preference: 0 (every seed
    preset) prices the first output as SEL-5 does."""
    cost_drift_weight: float = 0.0
    """flare's shared speed factor w in [0, 1]: each cost sample moves every shape's
    estimate by ``w`` times its log residual (``policy/cost_drift.py``). Not a seed
    preference: 0 (every preset) keeps the seed's per-shape medians (DUR-8, DUR-9);
    ``flare run`` sets 0.1 on the cpu backend, whose speed drifts."""
    client_fairness: float = 0.0
    """flare's per-client fairness exponent s: fairness prices weighted by the request's
    client share ``(n / (k * n_c)) ** s`` (``policy/client_shares.py``). Not a seed
    preference: 0 (every seed preset) is the seed's per-request price (SEL-5..7)."""
    stream_start_ms: float = 0.0
    """flare's stream-start value H, ms: a prompt's first output is worth the output
    tokens its decode stream then delivers over H ms, ``max(1, H / sigma)`` times one
    output token's value, with sigma the decoders' reference delivery interval
    (``policy.prompt_prices.first_output_weight``). Not a seed preference: 0 (every seed
    preset) prices the first output as one token (SEL-5)."""
    stream_gap_ratio: float = 0.0
    """flare's stream gap limit r: while streams decode, a frame with a prompt chunk may
    hold them at most r times the shortest measured frame that does (a chunk rides
    beside every stream where a mixed program carries them all), less what the
    longest-waiting stream has already waited (U-13,
    ``policy.candidates.Candidates._within_gap``). Not a seed preference: 0 (every seed
    preset) sets no limit, as POL-11 asks; otherwise at least 1."""
    spare_decode_age_price: float = 0.0
    """flare's spare-row decode age price, value/ms^2: while fewer requests are
    resident than the widest decode program has rows, none of them took the last row
    (an overload episode, ``policy.decision.takes_last_row``), and the measured
    estimates show a throughput knee there, decoders age at the larger of this and
    ``decode_age_price`` (``policy.decision.decode_age_price``, ``has_knee``). Not a
    seed preference: 0 (every seed preset) keeps the seed's c_i (POL-5)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ``PolicyConfigError`` naming the first bad one."""
        for spec in fields(self):
            _check_field(spec.name, getattr(self, spec.name))


def _check_field(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyConfigError(f"{name} must be a number, got {value!r}")
    if name == "estimate_ttl_ns" and not isinstance(value, int):
        raise PolicyConfigError(f"estimate_ttl_ns must be an integer number of ns, got {value!r}")
    if not math.isfinite(value):
        raise PolicyConfigError(f"{name} must be finite, got {value!r}")
    if name == "stream_gap_ratio" and 0 < value < 1:
        raise PolicyConfigError(f"stream_gap_ratio must be 0 or at least 1, got {value!r}")
    if name == "cost_drift_weight" and value > 1:
        raise PolicyConfigError(f"cost_drift_weight must be at most 1, got {value!r}")
    if name in _POSITIVE_FIELDS:
        if value <= 0:
            raise PolicyConfigError(f"{name} must be greater than zero, got {value!r}")
    elif value < 0:
        raise PolicyConfigError(f"{name} must be non-negative, got {value!r}")


POLICY_PRESETS: dict[str, PolicyConfig] = {
    # POL-14: the default coefficients.
    "balanced": PolicyConfig(),
    # POL-15: keep token fairness and output-token value, drop delivery fairness and age.
    "throughput": PolicyConfig(delivery_fairness=0.0, decode_age_price=0.0),
    # flare's extension (docs/scheduling-utility.md, *First-token urgency*): balanced,
    # plus a prompt-age price and a retirement worth a freed request slot.
    "first-token": PolicyConfig(prompt_age_price=0.03, terminal_value=10_000.0),
    # flare's extension (docs/scheduling-utility.md, *Per-client fairness*): balanced,
    # with every client's requests together holding one client's fairness weight.
    "client-fair": PolicyConfig(client_fairness=1.0),
    # flare's extension (docs/scheduling-utility.md, *Stream start*): balanced, with a
    # prompt's first output worth the stream it starts over the adaptation time.
    "stream-start": PolicyConfig(stream_start_ms=100.0),
    # flare's extension (docs/scheduling-utility.md, *Steady streams*): first-token with
    # a strong urgency that a started prompt keeps until its first output, and a prompt
    # chunk beside the decoding streams in a frame at most 1.15 times the shortest one
    # that carries them with a chunk.
    "steady": PolicyConfig(prompt_age_price=5.0, finish_age_price=5.0,
                           terminal_value=10_000.0, stream_gap_ratio=1.15),
    # flare's extension (docs/scheduling-utility.md, *Spare rows*): first-token with
    # a decoder output-age price 500x the seed's while a decode row is spare outside an
    # overload episode and the costs show a knee, so there the chunk that keeps the
    # decode cadence wins (SEL-48).
    "smooth": PolicyConfig(prompt_age_price=0.03, terminal_value=10_000.0,
                           spare_decode_age_price=50.0),
}
"""The ``--scheduler-policy`` presets by name."""


def policy_preset(
    name: str,
    *,
    terminal_value: float | None = None,
    terminal_age_price: float | None = None,
    adaptive_verification_alpha: float | None = None,
) -> PolicyConfig:
    """The named preset with the CLI overrides applied after it (POL-14..23).

    ``None`` leaves the preset's value. Overrides are validated like every field: the
    terminal ones must be finite and non-negative (POL-19; zero disables the preference,
    POL-20), alpha finite and greater than zero (POL-23).
    """
    try:
        config = POLICY_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(POLICY_PRESETS))
        raise PolicyConfigError(
            f"unknown scheduler policy {name!r}; expected one of: {known}"
        ) from None
    if terminal_value is not None:
        config = replace(config, terminal_value=terminal_value)
    if terminal_age_price is not None:
        config = replace(config, terminal_age_price=terminal_age_price)
    if adaptive_verification_alpha is not None:
        config = replace(config, adaptive_verification_alpha=adaptive_verification_alpha)
    return config
