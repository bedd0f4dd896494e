"""The runtime's scheduling policy, built from the runtime's configuration.

``make_scheduler`` chooses the policy the planner drives (``--scheduler-policy``, and
with ``--speculation`` the seed's scheduler speculating with the configured proposal
source); ``admission_prefill`` the prefill times the least-slack admission order
reads; ``counterfactual_copy_depth`` and ``learned_counterfactuals`` say which
counterfactual rounds the planner replays for it; ``seed_estimates`` records start-up
measurements in it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from policy import (
    PRESET_POLICIES,
    GraphKind,
    GraphShape,
    PolicyConfig,
    ProposalSource,
    Scheduler,
    SchedulingPolicy,
    SpeculationMode,
    SpeculationSettings,
    make_policy,
    policy_preset,
    pure_prefill_ns,
)

if TYPE_CHECKING:
    from actors.config import RuntimeConfig
    from actors.system import RuntimeParts


def runtime_policy(config: RuntimeConfig) -> PolicyConfig:
    """The preferences the runtime's policy runs with: the ``--scheduler-policy`` preset
    (``balanced`` for a baseline, which only reads its estimate settings), the CLI's
    overrides, and the backend's cost drift weight (``policy/cost_drift.py``)."""
    preset = policy_preset(
        config.scheduler_policy if config.scheduler_policy in PRESET_POLICIES else "balanced",
        terminal_value=config.scheduler_terminal_value,
        terminal_age_price=config.scheduler_terminal_age_price,
        adaptive_verification_alpha=config.adaptive_verification_alpha)
    return replace(preset, cost_drift_weight=config.effective_cost_drift_weight)


def admission_prefill(order: str, scheduler: SchedulingPolicy,
                      catalog: Sequence[GraphShape]) -> Callable[[int], float | None] | None:
    """The least-slack admission order's pure prefill time of a prompt length, from the
    scheduler's current estimates of the catalog's prefill programs (None while none is
    known: that request queues FIFO); None for the FIFO order."""
    if order != "least-slack":
        return None
    shapes = tuple(s for s in catalog if s.kind is GraphKind.PREFILL and s.token_capacity > 0)
    estimates = scheduler.estimates

    def prefill_ns(prompt_tokens: int) -> float | None:
        known = [(s.token_capacity, estimates.estimate_ns(s)) for s in shapes
                 if estimates.is_known(s)]
        return pure_prefill_ns(prompt_tokens, known) if known else None

    return prefill_ns


def make_scheduler(parts: RuntimeParts, catalog: Sequence[GraphShape], *,
                   max_context: int) -> SchedulingPolicy:
    """The planner's scheduler: the configured policy, or with speculation the seed's
    scheduler with complete speculative rounds (fixed mode: fixed widths, complete
    prefixes, no acceptance probes, LRN-10). A ``fixed-spec-K`` baseline runs its own
    rounds on the speculative load (host lengths, completed like any generation frame)."""
    if parts.speculation == "off" or parts.scheduler_policy.startswith("fixed-spec-"):
        return make_policy(parts.scheduler_policy, parts.policy, catalog=catalog)
    mode = SpeculationMode(parts.speculation)
    return Scheduler(parts.policy, catalog, speculation=SpeculationSettings(
        mode=mode, source=ProposalSource(parts.draft_source), context_limit=max_context,
        # depth-(D + 1) observations of learned rounds (RuntimeConfig.draft_counterfactuals)
        depth_beyond=parts.draft_counterfactuals and parts.draft_source == "draft"
        and mode is SpeculationMode.ADAPTIVE))


def counterfactual_copy_depth(parts: RuntimeParts, scheduler: SchedulingPolicy,
                              catalog: Sequence[GraphShape]) -> int:
    """Drafts per counterfactual copy round (the deepest copy round in the catalog), or
    0 where the planner keeps none: only a scheduler that learns acceptance, with copy
    proposals, learns from them (``RuntimeConfig.copy_counterfactuals``)."""
    if not (parts.copy_counterfactuals and parts.draft_source == "copy"
            and scheduler.learns_acceptance):
        return 0
    return max((s.proposal_depth for s in catalog if s.kind is GraphKind.SPECULATIVE),
               default=0)


def learned_counterfactuals(parts: RuntimeParts, scheduler: SchedulingPolicy) -> bool:
    """Whether the planner folds the learned draft's depth-one proposals into the
    scheduler: only a scheduler that learns acceptance, with the learned source, learns
    from them (``RuntimeConfig.draft_counterfactuals``)."""
    return (parts.draft_counterfactuals and parts.draft_source == "draft"
            and scheduler.learns_acceptance)


def seed_estimates(scheduler: SchedulingPolicy, measured: Mapping[GraphShape, int], *,
                   now_ns: int) -> None:
    """Record start-up measurements as observations in the policy's duration
    estimates (the baselines keep them for traces only)."""
    estimates = scheduler.estimates
    for shape, duration_ns in measured.items():
        estimates.observe(shape, duration_ns, max(now_ns, 0))


def structured_output_problem(parts: RuntimeParts) -> str:
    """Why grammar-constrained requests cannot run under the configured policy ("" when
    they can): a ``fixed-spec-K`` baseline puts every decode on speculative rows, and
    constrained requests never speculate (SEL-13, ``policy.grammar_feedback``), so they
    are refused at admission rather than left waiting for a frame that never comes.
    Fixed-width speculation serves them: its catalog keeps the ordinary decode programs,
    which only constrained requests run on (MIX-7, ``gpu.catalog.fixed_width_shapes``)."""
    if parts.scheduler_policy.startswith("fixed-spec-"):
        return (f"structured output is not available under --scheduler-policy "
                f"{parts.scheduler_policy} (it speculates every decode)")
    return ""


def grammars_resident(parts: RuntimeParts) -> bool:
    """Whether the prepared programs declare resident grammars (``holds_grammars``,
    ``gpu.grammar_rows``): constrained requests are then admitted to the policy as
    ``grammar_resident`` and their frames need no completion feedback."""
    return any(getattr(p, "holds_grammars", False) for p in parts.programs.values())
