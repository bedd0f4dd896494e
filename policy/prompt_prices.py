"""flare's opt-in extensions to the prices of a prompt row (``docs/scheduling-utility.md``).

Each is off under every seed preset, where the prices are exactly SEL-5's:

- ``first_token_prices``: the first-token urgency, a token price that grows with the
  prompt's wait (U-10);
- ``first_output_weight``: the stream-start value, a first output worth the stream it
  starts (U-12);
- ``first_output_values``: the first output's value with that weight and the finish
  urgency, the wait's price on the prompt tokens before the finishing chunk (U-14).
"""

from __future__ import annotations

from policy.config import PolicyConfig


def first_token_prices(prompt_x: list[float], prompt_age_ms: list[float],
                       config: PolicyConfig) -> list[float]:
    """Each prompt row's unscaled prefill token price: the seed's ``1 + f/x`` (SEL-5),
    plus, with flare's opt-in first-token urgency (``prompt_age_price`` u > 0),
    ``u * A`` for a prompt that arrived ``A`` ms before the planning start
    (``docs/scheduling-utility.md``, *First-token urgency*)."""
    tf, u = config.token_fairness, config.prompt_age_price
    if not u:
        return [1.0 + tf / x for x in prompt_x]
    return [1.0 + tf / x + u * age for x, age in zip(prompt_x, prompt_age_ms, strict=True)]


def first_output_weight(config: PolicyConfig, sigma: float | None) -> float:
    """How many output tokens a prompt's first output is worth: 1 (the seed, SEL-5),
    or with flare's stream-start value (``stream_start_ms`` H > 0) the tokens its
    decode stream delivers over H ms, ``max(1, H / sigma)`` with sigma the decoders'
    reference delivery interval, one stream's when none decodes
    (``docs/scheduling-utility.md``, *Stream start*)."""
    horizon = config.stream_start_ms
    if horizon <= 0 or sigma is None or sigma <= 0:
        return 1.0
    return max(1.0, horizon / sigma)


def first_output_values(prompt_x: list[float], prompt_z: list[float],
                        prompt_age_ms: list[float], before: list[int], config: PolicyConfig,
                        weight: float) -> list[float]:
    """Each prompt row's unscaled first-output value, credited to the chunk that finishes
    the prompt: ``weight`` (``first_output_weight``) output tokens at ``beta + f/x + g/z``
    (SEL-5), plus, with flare's finish urgency (``finish_age_price`` v > 0), ``v * A``
    for each of the ``before`` prompt tokens computed or cached before the row's next
    chunk, ``A`` ms after the prompt arrived (``docs/scheduling-utility.md``, *Steady
    streams*, U-14)."""
    beta, tf, g = config.output_token_value, config.token_fairness, config.delivery_fairness
    v = config.finish_age_price  # 0 adds exactly 0.0: the seed's value, bit for bit
    return [(beta + tf / x + g / z) * weight + v * age * done
            for x, z, age, done in zip(prompt_x, prompt_z, prompt_age_ms, before, strict=True)]
