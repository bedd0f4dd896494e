"""``make_policy``: one name per policy the simulator and ``--scheduler-policy`` select.

``balanced`` and ``throughput`` are the seed's ``Scheduler`` with that preset
(``policy.config.policy_preset``, POL-14, POL-15); ``fcfs``, ``sarathi`` and ``vtc`` are
the baselines of this package. Every result satisfies ``policy.baselines.Planner``.
"""

from __future__ import annotations

from collections.abc import Iterable

from policy.baselines.fcfs import FcfsPolicy
from policy.baselines.protocol import Planner
from policy.baselines.sarathi import DEFAULT_TOKEN_BUDGET, SarathiPolicy
from policy.baselines.vtc import VtcPolicy
from policy.config import PolicyConfig, PolicyConfigError, policy_preset
from policy.descriptors import GraphShape
from policy.scheduler import Scheduler

SEED_POLICIES = ("balanced", "throughput")
BASELINE_POLICIES = ("fcfs", "sarathi", "vtc")
POLICY_NAMES = SEED_POLICIES + BASELINE_POLICIES


def make_policy(name: str, config: PolicyConfig | None = None, *,
                catalog: Iterable[GraphShape] = (),
                token_budget: int = DEFAULT_TOKEN_BUDGET) -> Planner:
    """A fresh policy by name.

    For the seed's names, ``config`` (when given) replaces the preset entirely; for the
    baselines it only sets the estimate freshness interval. ``token_budget`` is the
    chunked-prefill budget of ``sarathi`` and ``vtc``.
    """
    shapes = tuple(catalog)
    if name in SEED_POLICIES:
        return Scheduler(config if config is not None else policy_preset(name), shapes)
    if name == "fcfs":
        return FcfsPolicy(config, shapes)
    if name == "sarathi":
        return SarathiPolicy(config, shapes, token_budget=token_budget)
    if name == "vtc":
        return VtcPolicy(config, shapes, token_budget=token_budget)
    raise PolicyConfigError(
        f"unknown scheduler policy {name!r}; expected one of: {', '.join(POLICY_NAMES)}")
