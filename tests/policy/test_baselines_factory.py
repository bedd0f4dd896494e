"""``make_policy``: every policy name builds a planner with the seed's interface.

Covers policy selection by name and POL-14/POL-15 (the seed presets).
"""

from __future__ import annotations

import pytest
from test_baselines_fcfs import CATALOG

from policy import Scheduler
from policy.baselines import (
    POLICY_NAMES,
    FcfsPolicy,
    SarathiPolicy,
    VtcPolicy,
    make_policy,
)
from policy.config import PolicyConfigError, policy_preset
from policy.protocol import SchedulingPolicy


@pytest.mark.parametrize(("name", "kind"), [
    ("balanced", Scheduler), ("throughput", Scheduler), ("fcfs", FcfsPolicy),
    ("sarathi", SarathiPolicy), ("vtc", VtcPolicy)])
def test_make_policy_builds_each_name(name: str, kind: type) -> None:
    policy = make_policy(name, catalog=CATALOG)
    assert type(policy) is kind
    assert isinstance(policy, SchedulingPolicy)
    assert set(policy.catalog) == set(CATALOG)  # type: ignore[attr-defined]


def test_seed_names_use_their_presets() -> None:
    assert make_policy("throughput").config == policy_preset("throughput")  # type: ignore[attr-defined]
    assert make_policy("balanced").config == policy_preset("balanced")  # type: ignore[attr-defined]


def test_budget_reaches_chunked_baselines_and_unknown_names_fail() -> None:
    policy = make_policy("vtc", catalog=CATALOG, token_budget=128)
    assert isinstance(policy, VtcPolicy) and policy.token_budget == 128
    with pytest.raises(PolicyConfigError, match="unknown scheduler policy"):
        make_policy("lottery")
    assert POLICY_NAMES[:12] == ("balanced", "throughput", "first-token", "client-fair",
                                 "smooth", "stream-start", "steady", "spec-adaptive",
                                 "spec-fixed", "fcfs", "sarathi", "vtc")
    assert POLICY_NAMES[12:] == tuple(f"fixed-spec-{k}" for k in range(1, 8))


@pytest.mark.parametrize(("name", "mode"), [("spec-adaptive", "adaptive"),
                                            ("spec-fixed", "fixed")])
def test_speculative_seed_names_build_the_speculative_scheduler(name: str, mode: str) -> None:
    """What ``flare run --speculation adaptive|fixed`` runs, with the balanced preset."""
    policy = make_policy(name, catalog=CATALOG, context_limit=512)
    assert isinstance(policy, Scheduler) and policy.speculation is not None \
        and policy.speculation.mode.value == mode
    assert policy.config == policy_preset("balanced")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_offers_what_the_runtime_planner_reads(name: str) -> None:
    """The runtime's planner reads ``request(h).epoch``, ``now_ns`` and ``in_flight()``."""
    policy = make_policy(name, catalog=CATALOG)
    policy.advance_to(5)
    h = policy.admit(prompt_len=10, max_output_tokens=2)
    assert policy.request(h).epoch == 0 and policy.request(h).handle == h
    assert policy.now_ns == 5 and policy.in_flight() == ()
