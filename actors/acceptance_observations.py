"""What the planner reports to its policy about acceptance besides completing frames.

A policy that learns acceptance (``SchedulingPolicy.learns_acceptance``) learns from
the rounds its frames ran (``complete``'s ``round``, built by ``round_completion``)
and from rounds no frame ran, which the host can replay:

- counterfactual copy rounds (``actors.copy_counterfactuals``): a decode lane that
  verified no copy drafts opens one from the context the frame started from, and later
  tokens decide it (``counterfactual_depth`` drafts deep; 0: none are kept);
- depth-one learned rounds (``learned_counterfactuals``): a width-one step that kept
  the draft context reports the draft's proposal for each lane's token.

Every decided counterfactual goes to ``observe_counterfactual`` and the planner's
counters (``count_round`` keeps those of the rounds that did run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from actors.copy_counterfactuals import CopyCounterfactuals
from actors.frame_inputs import LaneSource
from actors.messages import SpeculativeRounds, ValidatedFrame
from actors.planner_records import PlannerCounters
from gpu.engine import COPY_MAX_NGRAM
from policy import (
    GeneratedToken,
    LaneRole,
    RequestHandle,
    RoundCompletion,
    RoundLaneOutcome,
    SchedulingPolicy,
)


class ObservedResident(Protocol):
    """What the observations read and keep of a resident request."""

    source: LaneSource
    counterfactuals: CopyCounterfactuals | None


def round_completion(rounds: SpeculativeRounds) -> RoundCompletion:
    """The policy's view of a validated frame's round sidecars."""
    return RoundCompletion(
        lanes=tuple(RoundLaneOutcome(handle=lane.handle, proposed=lane.proposed,
                                     evaluated=lane.evaluated, accepted=lane.accepted,
                                     survival=lane.survival, beyond=lane.beyond)
                    for lane in rounds.lanes),
        confidence=rounds.confidence)


def count_round(c: PlannerCounters, rounds: SpeculativeRounds) -> None:
    """A validated speculative frame in the planner's counters."""
    c.speculative_frames += 1
    for lane in rounds.lanes:
        c.drafted_tokens += lane.evaluated
        c.accepted_tokens += lane.accepted
        while len(c.accepted_by_position) < lane.accepted:
            c.accepted_by_position.append(0)
        for k in range(lane.accepted):
            c.accepted_by_position[k] += 1


class AcceptanceObservations:
    """The counterfactual rounds one planner reports to its policy."""

    def __init__(self, scheduler: SchedulingPolicy, counters: PlannerCounters, *,
                 counterfactual_depth: int, learned_counterfactuals: bool) -> None:
        self._scheduler = scheduler
        self._counters = counters
        self._depth = counterfactual_depth
        self._learned = learned_counterfactuals

    def completed(self, frame: ValidatedFrame, tokens: Sequence[GeneratedToken],
                  residents: Mapping[RequestHandle, ObservedResident]) -> None:
        """After the policy completed ``frame`` with these ``tokens`` (before they are
        appended to the residents' outputs)."""
        if self._depth:
            self._copy_rounds(frame, tokens, residents)
        if self._learned and (frame.draft_proposals or frame.draft_acceptances):
            self._draft_proposals(frame, tokens, residents)

    def _copy_rounds(self, frame: ValidatedFrame, tokens: Sequence[GeneratedToken],
                     residents: Mapping[RequestHandle, ObservedResident]) -> None:
        """Counterfactual copy rounds (``actors.copy_counterfactuals``): a decode lane
        that verified no copy drafts opens one from the context the frame started from
        (before its tokens are appended); every lane's new tokens decide the open ones,
        and the request's end censors the rest (ACC-8)."""
        verified = ({lane.handle: lane.evaluated for lane in frame.rounds.lanes}
                    if frame.rounds is not None else {})
        decoding = {lane.handle for lane in frame.plan.lanes if lane.role is LaneRole.DECODE}
        for token in tokens:
            resident = residents.get(token.handle)
            if resident is None or resident.source.epoch != token.epoch:
                continue
            tracker = resident.counterfactuals
            if token.handle in decoding and not verified.get(token.handle, 0):
                if tracker is None:
                    source = resident.source
                    tracker = resident.counterfactuals = CopyCounterfactuals.starting_from(
                        (*source.prompt, *source.output_ids),
                        depth=self._depth, max_ngram=COPY_MAX_NGRAM)
                tracker.open_round()
            if tracker is None:
                continue
            decided = [(o, a, False) for o, a in tracker.extend(token.token_ids)]
            if token.finish is not None:
                decided += [(o, a, True) for o, a in tracker.terminate()]
            for offered, accepted, ended in decided:
                self._observe(token.handle, offered, accepted, ended)

    def _draft_proposals(self, frame: ValidatedFrame, tokens: Sequence[GeneratedToken],
                         residents: Mapping[RequestHandle, ObservedResident]) -> None:
        """Depth-one counterfactual learned rounds: a width-one step that kept the
        draft context reported the draft's greedy proposal for each lane's token; for a
        greedy request, the proposal equal to the emitted token is exactly what a
        depth-one round would have accepted. A sampled request observes the step's
        ``sum min(p, q)`` instead, the probability that the round's rejection sampling
        would have accepted a draft (as survival values replace binary observations,
        ACC-28); a match of two samples is not the acceptance event."""
        emitted = {t.handle: t for t in tokens if t.token_ids}

        def live(handle: RequestHandle) -> GeneratedToken | None:
            token, resident = emitted.get(handle), residents.get(handle)
            if token is None or resident is None or resident.source.epoch != token.epoch:
                return None
            return token

        def greedy(handle: RequestHandle) -> bool:
            return residents[handle].source.sampling.temperature <= 0.0

        for handle, proposal in frame.draft_proposals:
            token = live(handle)
            if token is not None and greedy(handle):
                self._observe(handle, 1, int(token.token_ids[0] == proposal), False)
        for handle, acceptance in frame.draft_acceptances:
            if live(handle) is not None and not greedy(handle):
                self._observe(handle, 1, int(acceptance >= 0.5), False,
                              survival=(acceptance,))

    def _observe(self, handle: RequestHandle, offered: int, accepted: int, terminated: bool,
                 survival: tuple[float, ...] | None = None) -> None:
        """One decided counterfactual round, of either source: to the scheduler and the
        counters (a sampled depth-one round counts as accepted when its acceptance
        probability is at least one half)."""
        self._scheduler.observe_counterfactual(handle, offered=offered, accepted=accepted,
                                               terminated=terminated, survival=survival)
        self._counters.counterfactual_rounds += 1
        self._counters.counterfactual_drafted_tokens += offered
        self._counters.counterfactual_accepted_tokens += accepted
