"""Baseline scheduling policies behind the seed scheduler's planner interface.

``fcfs`` (prefill-first continuous batching), ``sarathi`` (chunked prefill with
piggybacked decodes under a token budget) and ``vtc`` (virtual token counter fairness
across clients) run on the same prepared shapes as ``policy.Scheduler`` and expose the
same methods and value types (``Planner``), so ``flare sim`` and the runtime's planner
can drive any of them. ``make_policy(name, config)`` builds one by name. Pure like the
rest of ``policy``: no clocks, no randomness, no I/O.
"""

from policy.baselines.base import DEFAULT_CLIENT, BaselinePolicy, BaselineRequest
from policy.baselines.factory import (
    BASELINE_POLICIES,
    POLICY_NAMES,
    SEED_POLICIES,
    make_policy,
)
from policy.baselines.fcfs import FcfsPolicy
from policy.baselines.menu import PromptWork, ShapeMenu
from policy.baselines.protocol import ClientTagged, Planner
from policy.baselines.sarathi import DEFAULT_TOKEN_BUDGET, SarathiPolicy
from policy.baselines.vtc import VtcPolicy

__all__ = [
    "BASELINE_POLICIES",
    "DEFAULT_CLIENT",
    "DEFAULT_TOKEN_BUDGET",
    "POLICY_NAMES",
    "SEED_POLICIES",
    "BaselinePolicy",
    "BaselineRequest",
    "ClientTagged",
    "FcfsPolicy",
    "Planner",
    "PromptWork",
    "SarathiPolicy",
    "ShapeMenu",
    "VtcPolicy",
    "make_policy",
]
