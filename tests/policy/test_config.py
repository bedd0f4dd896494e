"""PolicyConfig defaults, presets and validation (seed: Policy preferences)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from policy.config import POLICY_PRESETS, PolicyConfig, PolicyConfigError, policy_preset


def test_pol_2_to_10_defaults() -> None:
    """Covers POL-2..POL-10, ACC-4: the seed's default coefficients."""
    c = PolicyConfig()
    assert c.output_token_value == 64
    assert c.token_fairness == 16
    assert c.delivery_fairness == 4
    assert c.decode_age_price == 0.1
    assert c.terminal_value == 256
    assert c.terminal_age_price == 1
    assert c.adaptation_ms == 100
    assert c.estimate_ttl_ns == 30_000_000_000
    assert c.adaptive_verification_alpha == 1
    assert c.checkpoint_extra_work_fraction == 0.05


def test_pol_14_balanced_is_the_default_config() -> None:
    """Covers POL-14: balanced uses the default coefficients."""
    assert policy_preset("balanced") == PolicyConfig()


def test_pol_15_throughput_preset() -> None:
    """Covers POL-15: throughput keeps f and beta, zeroes g and the decode-age price."""
    t = policy_preset("throughput")
    assert (t.token_fairness, t.output_token_value) == (16, 64)
    assert (t.delivery_fairness, t.decode_age_price) == (0, 0)
    # Everything else is the default.
    assert dataclasses.replace(t, delivery_fairness=4.0, decode_age_price=0.1) == PolicyConfig()


def test_pol_18_terminal_overrides_after_preset() -> None:
    """Covers POL-18, POL-20, POL-21: overrides land after preset selection; zero is allowed."""
    t = policy_preset("throughput", terminal_value=10)
    assert t.terminal_value == 10 and t.delivery_fairness == 0
    off = policy_preset("throughput", terminal_value=0, terminal_age_price=0)
    assert (off.terminal_value, off.terminal_age_price) == (0, 0)
    assert policy_preset("balanced", terminal_age_price=2.5).terminal_age_price == 2.5


def test_pol_22_alpha_override() -> None:
    """Covers POL-22: the alpha flag value reaches PolicyConfig."""
    assert policy_preset("balanced", adaptive_verification_alpha=2.0).adaptive_verification_alpha == 2


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["terminal_value", "terminal_age_price"])
def test_pol_19_terminal_overrides_must_be_finite_non_negative(field: str, bad: float) -> None:
    """Covers POL-19: -1, nan and inf are rejected with an error naming the field."""
    with pytest.raises(PolicyConfigError, match=field):
        policy_preset("throughput", **{field: bad})


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_pol_23_alpha_must_be_finite_and_positive(bad: float) -> None:
    """Covers POL-23: 0, -1, nan (and inf) are rejected."""
    with pytest.raises(PolicyConfigError, match="adaptive_verification_alpha"):
        policy_preset("balanced", adaptive_verification_alpha=bad)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(PolicyConfig)])
def test_open_29_every_field_finite_and_non_negative(field: str) -> None:
    """Covers OPEN-29 (decision: every field), OPEN-5 (the checkpoint fraction is a field)."""
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(PolicyConfigError, match=field):
            PolicyConfig(**{field: bad})


@pytest.mark.parametrize("field", ["adaptation_ms", "estimate_ttl_ns", "adaptive_verification_alpha"])
def test_open_29_time_constants_and_alpha_must_be_positive(field: str) -> None:
    """adaptation_ms, estimate_ttl_ns and alpha may not be zero."""
    with pytest.raises(PolicyConfigError, match="greater than zero"):
        PolicyConfig(**{field: 0})


def test_pol_12_zero_coefficients_are_valid() -> None:
    """Covers POL-12, POL-20: zero fairness and age coefficients are allowed."""
    c = PolicyConfig(token_fairness=0, delivery_fairness=0, decode_age_price=0,
                     terminal_value=0, terminal_age_price=0, checkpoint_extra_work_fraction=0)
    assert c.token_fairness == 0


def test_non_numbers_and_fractional_ttl_are_rejected() -> None:
    with pytest.raises(PolicyConfigError, match="token_fairness must be a number"):
        PolicyConfig(token_fairness="16")  # type: ignore[arg-type]
    with pytest.raises(PolicyConfigError, match="token_fairness must be a number"):
        PolicyConfig(token_fairness=True)
    with pytest.raises(PolicyConfigError, match="estimate_ttl_ns must be an integer"):
        PolicyConfig(estimate_ttl_ns=1.5)  # type: ignore[arg-type]


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(PolicyConfigError, match="balanced, client-fair, first-token, smooth, steady, stream-start, throughput"):
        policy_preset("fast")
    assert set(POLICY_PRESETS) == {"balanced", "client-fair", "first-token", "smooth",
                                   "steady", "stream-start", "throughput"}


def test_config_is_immutable_and_replace_revalidates() -> None:
    """The config is a frozen value; dataclasses.replace() validates again."""
    c = PolicyConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.token_fairness = 1.0  # type: ignore[misc]
    with pytest.raises(PolicyConfigError):
        dataclasses.replace(c, delivery_fairness=-0.5)
