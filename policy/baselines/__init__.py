"""Baseline scheduling policies behind the interface every policy offers.

``fcfs`` (prefill-first continuous batching), ``sarathi`` (chunked prefill with
piggybacked decodes under a token budget), ``vtc`` (virtual token counter fairness
across clients) and ``fixed-spec-K`` (every decode batch a complete speculative round
at proposal depth K, chunked prefill) run on the same prepared shapes as
``policy.Scheduler`` and implement ``policy.protocol.SchedulingPolicy``, so ``flare
sim`` and the runtime's planner can drive any of them. ``make_policy(name, config)`` builds one by name. Pure like the
rest of ``policy``: no clocks, no randomness, no I/O.
"""

from policy.baselines.base import DEFAULT_CLIENT, BaselinePolicy, BaselineRequest
from policy.baselines.factory import (
    BASELINE_POLICIES,
    COMPARED_POLICIES,
    FIXED_SPEC_POLICIES,
    POLICY_NAMES,
    PRESET_POLICIES,
    RUNTIME_POLICIES,
    SEED_POLICIES,
    SPECULATIVE_SEED_POLICIES,
    make_policy,
    speculative_policy,
)
from policy.baselines.fcfs import FcfsPolicy
from policy.baselines.fixed_spec import FixedSpecPolicy, fixed_spec_depth
from policy.baselines.menu import PromptWork, ShapeMenu
from policy.baselines.sarathi import DEFAULT_TOKEN_BUDGET, SarathiPolicy
from policy.baselines.vtc import VtcPolicy

__all__ = [
    "BASELINE_POLICIES",
    "COMPARED_POLICIES",
    "DEFAULT_CLIENT",
    "DEFAULT_TOKEN_BUDGET",
    "FIXED_SPEC_POLICIES",
    "POLICY_NAMES",
    "PRESET_POLICIES",
    "RUNTIME_POLICIES",
    "SEED_POLICIES",
    "SPECULATIVE_SEED_POLICIES",
    "BaselinePolicy",
    "BaselineRequest",
    "FcfsPolicy",
    "FixedSpecPolicy",
    "PromptWork",
    "SarathiPolicy",
    "ShapeMenu",
    "VtcPolicy",
    "fixed_spec_depth",
    "make_policy",
    "speculative_policy",
]
