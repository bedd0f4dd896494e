"""The runtime's scheduling preferences: the preset, the CLI's overrides and the
backend's cost drift weight (``actors.policy_setup.runtime_policy``,
``policy/cost_drift.py``)."""

from __future__ import annotations

import argparse
import math

import pytest

from actors.config import CPU_COST_DRIFT_WEIGHT, DEFAULT_MODEL_DIR, ConfigError, RuntimeConfig
from actors.policy_setup import runtime_policy
from ops.run_command import add_arguments, build_runtime_config


def run_flags(*flags: str) -> RuntimeConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_runtime_config(parser.parse_args(list(flags)))


def test_the_runtime_sets_the_weight_by_backend_unless_told() -> None:
    cpu = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR)
    assert runtime_policy(cpu).cost_drift_weight == CPU_COST_DRIFT_WEIGHT
    assert runtime_policy(RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, backend="cuda")).cost_drift_weight == 0
    told = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, cost_drift_weight=0.0, scheduler_policy="first-token")
    policy = runtime_policy(told)
    assert policy.cost_drift_weight == 0.0 and policy.prompt_age_price > 0
    for bad in (-0.5, 2.0, math.nan):
        with pytest.raises(ConfigError, match="--cost-drift-weight"):
            RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, cost_drift_weight=bad).validate()


def test_flare_run_passes_its_cost_drift_flag_on() -> None:
    assert run_flags().cost_drift_weight is None
    assert runtime_policy(run_flags()).cost_drift_weight == CPU_COST_DRIFT_WEIGHT
    assert runtime_policy(run_flags("--cost-drift-weight", "0")).cost_drift_weight == 0.0
    assert runtime_policy(run_flags("--cost-drift-weight", "0.3")).cost_drift_weight == 0.3


def test_flare_run_decodes_a_one_token_prompt_tail_unless_told_not_to() -> None:
    assert run_flags().decode_prompt_tail is True
    assert run_flags("--no-decode-prompt-tail").decode_prompt_tail is False
