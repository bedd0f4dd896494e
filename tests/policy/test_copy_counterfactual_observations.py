"""``Scheduler.observe_counterfactual``: a counterfactual copy round
folds into the request's copy acceptance exactly as a verified round would (ACC-6,
ACC-7), censored at termination (ACC-8), and moves the population prior (ACC-20), also
for a request already released; only a copy scheduler accepts one."""

from __future__ import annotations

import pytest

from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.round_speculation import SpeculationSettings
from policy.rounds import SpeculationMode
from policy.scheduler import Scheduler
from policy.speculation import AcceptanceState, PopulationPriors, ProposalSource
from tests.policy.test_speculative_scheduler import decoders, scheduler, spec

COPY = ProposalSource.COPY
SHAPES = [GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1,
                     packed_capacity=4),
          GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=4,
                     proposal_depth=3, packed_capacity=16, binding=TargetBinding.QUERY_LENGTH)]


def copy_scheduler() -> Scheduler:
    return Scheduler(catalog=SHAPES, speculation=SpeculationSettings(
        mode=SpeculationMode.ADAPTIVE, source=COPY))


def means(s: Scheduler, handle: int) -> list[float]:
    return [s.acceptance(handle).acceptance(COPY).mean(d) for d in (1, 2, 3, 4)]


@pytest.mark.parametrize(("offered", "accepted", "terminated"),
                         [(3, 1, False), (3, 3, False), (2, 0, False), (3, 1, True)])
def test_acc_6_7_8_a_counterfactual_observes_like_a_verified_round(
        offered: int, accepted: int, terminated: bool) -> None:
    s = copy_scheduler()
    h = s.admit(prompt_len=8, max_output_tokens=64)
    s.observe_counterfactual(h, offered=offered, accepted=accepted,
                                  terminated=terminated)
    reference = AcceptanceState(PopulationPriors())
    reference.observe_round(COPY, offered=offered, accepted=accepted, terminated=terminated)
    assert means(s, h) == pytest.approx(
        [reference.acceptance(COPY).mean(d) for d in (1, 2, 3, 4)])
    first = means(s, h)
    assert first[0] != pytest.approx(0.5)  # depth 1 was observed
    if terminated:
        assert first[accepted] == pytest.approx(0.5 ** (accepted + 1))  # censored
    assert first[3] == pytest.approx(0.5 ** 4)  # never offered


def test_acc_20_a_released_request_still_moves_the_population_prior() -> None:
    s = copy_scheduler()
    gone = 12345  # never admitted (or released): only the prior learns
    s.observe_counterfactual(gone, offered=1, accepted=1, terminated=False)
    fresh = s.admit(prompt_len=8, max_output_tokens=64)
    assert means(s, fresh)[0] == pytest.approx(0.5 + 0.5 / 64)
    assert means(s, fresh)[1] == pytest.approx(0.25)


@pytest.mark.parametrize("accepted", [0, 1])
def test_acc_6_7_a_learned_depth_one_counterfactual_observes_the_learned_source(
        accepted: int) -> None:
    """A learned scheduler folds a depth-one counterfactual (a width-one step's draft
    proposal against the emitted token) into its own source, like a verified
    depth-one round, and leaves the copy source alone."""
    learned = ProposalSource.LEARNED
    s = Scheduler(catalog=SHAPES, speculation=SpeculationSettings(
        mode=SpeculationMode.ADAPTIVE, source=learned))
    h = s.admit(prompt_len=8, max_output_tokens=64)
    s.observe_counterfactual(h, offered=1, accepted=accepted, terminated=False)
    reference = AcceptanceState(PopulationPriors())
    reference.observe_round(learned, offered=1, accepted=accepted, terminated=False)
    observed = [s.acceptance(h).acceptance(learned).mean(d) for d in (1, 2)]
    assert observed == pytest.approx(
        [reference.acceptance(learned).mean(d) for d in (1, 2)])
    assert observed[0] != pytest.approx(0.5)
    assert means(s, h)[0] == pytest.approx(0.5)  # copy: untouched


def test_matching_counterfactuals_bring_back_the_rounds_decodes_alone_never_would() -> None:
    """Why counterfactual rounds exist: a request whose copy estimate fell keeps width one
    (decodes observe nothing, ACC-9, and ordinary selection never probes); once the
    counterfactual rounds of its decodes match, the same selection plans the widest round
    (SEL-24 on the estimates they moved)."""
    s = scheduler(source=COPY)
    handles = decoders(s)
    for h in handles:
        s.preseed_acceptance(h, (0.02, 0.01, 0.0), weight=8.0)
    plan = s.plan()
    assert plan is not None and plan.shape.token_capacity == 1
    for _ in range(60):
        for h in handles:
            s.observe_counterfactual(h, offered=3, accepted=3, terminated=False)
    plan = s.plan()
    assert plan is not None and plan.shape == spec(4)
    assert {lane.handle for lane in plan.lanes} == set(handles)
