"""``make_policy``: one name per policy the simulator and ``--scheduler-policy`` select.

``balanced`` and ``throughput`` are the seed's ``Scheduler`` with that preset
(``policy.config.policy_preset``, POL-14, POL-15), ``first-token``, ``client-fair``,
``smooth`` and ``stream-start`` the same ``Scheduler`` with flare's extension presets
(``docs/scheduling-utility.md``: U-10, U-11, *Smooth streams*, U-12); ``spec-adaptive`` and
``spec-fixed`` are the seed's ``Scheduler`` speculating with the learned source and the
``balanced`` preset in that mode (what ``flare run --speculation adaptive|fixed`` runs; named for
``flare sim``, which compares them side by side; adaptive folds depth-``(D + 1)``
observations as ``flare run`` does by default); ``fcfs``, ``sarathi``, ``vtc`` and
``fixed-spec-1`` .. ``fixed-spec-7`` are the baselines of this package. Every result
satisfies ``policy.protocol.SchedulingPolicy``.

This module is the one home of the policy names: ``RUNTIME_POLICIES`` is what
``--scheduler-policy`` accepts and ``COMPARED_POLICIES`` what ``flare sim`` and the
comparison benchmark run by default.
"""

from __future__ import annotations

from collections.abc import Iterable

from policy.baselines.fcfs import FcfsPolicy
from policy.baselines.fixed_spec import MAX_FIXED_DEPTH, FixedSpecPolicy, fixed_spec_depth
from policy.baselines.sarathi import DEFAULT_TOKEN_BUDGET, SarathiPolicy
from policy.baselines.vtc import VtcPolicy
from policy.config import PolicyConfig, PolicyConfigError, policy_preset
from policy.descriptors import GraphShape
from policy.protocol import SchedulingPolicy
from policy.round_speculation import SpeculationSettings
from policy.rounds import SpeculationMode
from policy.scheduler import Scheduler

SEED_POLICIES = ("balanced", "throughput")
EXTENSION_PRESETS = ("first-token", "client-fair", "smooth", "stream-start", "steady")
"""flare's own presets of the seed's ``Scheduler`` (``policy.config.POLICY_PRESETS``):
opt-in departures from the seed's rules or its default coefficients, never the default."""
PRESET_POLICIES = SEED_POLICIES + EXTENSION_PRESETS
"""Every name that runs the seed's ``Scheduler`` with a preset of that name."""
SPECULATIVE_SEED_POLICIES = ("spec-adaptive", "spec-fixed")
"""The seed's speculative scheduler (``balanced`` preset) in adaptive or fixed-width mode."""
FIXED_SPEC_POLICIES = tuple(f"fixed-spec-{k}" for k in range(1, MAX_FIXED_DEPTH + 1))
BASELINE_POLICIES = ("fcfs", "sarathi", "vtc", *FIXED_SPEC_POLICIES)
POLICY_NAMES = PRESET_POLICIES + SPECULATIVE_SEED_POLICIES + BASELINE_POLICIES
RUNTIME_POLICIES = PRESET_POLICIES + BASELINE_POLICIES
"""``--scheduler-policy``: speculation is its own flag there (``--speculation``)."""
COMPARED_POLICIES = (*SEED_POLICIES, "fcfs", "sarathi", "vtc")
"""The policies a comparison runs when none are named."""


def speculative_policy(name: str) -> bool:
    """Whether ``name`` runs complete speculative rounds (needs a speculative load)."""
    return name in SPECULATIVE_SEED_POLICIES or fixed_spec_depth(name) is not None


def make_policy(name: str, config: PolicyConfig | None = None, *,
                catalog: Iterable[GraphShape] = (),
                token_budget: int = DEFAULT_TOKEN_BUDGET,
                context_limit: int | None = None) -> SchedulingPolicy:
    """A fresh policy by name.

    For the seed's names, ``config`` (when given) replaces the preset entirely; for the
    baselines it only sets the estimate freshness interval. ``token_budget`` is the
    chunked-prefill budget of ``sarathi``, ``vtc`` and ``fixed-spec-K``.
    ``context_limit`` bounds the speculative seed policies' rounds by context positions.
    """
    shapes = tuple(catalog)
    if name in PRESET_POLICIES:
        return Scheduler(config if config is not None else policy_preset(name), shapes)
    if name in SPECULATIVE_SEED_POLICIES:
        adaptive = name == "spec-adaptive"
        settings = SpeculationSettings(
            mode=SpeculationMode.ADAPTIVE if adaptive else SpeculationMode.FIXED,
            context_limit=context_limit, depth_beyond=adaptive)
        return Scheduler(config if config is not None else policy_preset("balanced"),
                         shapes, speculation=settings)
    if name == "fcfs":
        return FcfsPolicy(config, shapes)
    if name == "sarathi":
        return SarathiPolicy(config, shapes, token_budget=token_budget)
    if name == "vtc":
        return VtcPolicy(config, shapes, token_budget=token_budget)
    depth = fixed_spec_depth(name)
    if depth is not None and name in FIXED_SPEC_POLICIES:
        return FixedSpecPolicy(config, shapes, depth=depth, token_budget=token_budget)
    raise PolicyConfigError(
        f"unknown scheduler policy {name!r}; expected one of: {', '.join(POLICY_NAMES)}")
