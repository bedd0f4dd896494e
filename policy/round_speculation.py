"""``RoundSpeculation``: what complete speculative rounds add to the ``Scheduler``.

The seed's ``Scheduler`` holds one of these when it is configured with
``SpeculationSettings`` (a proposal source and a selection mode); without one it plans
ordinary programs only. The component keeps its own state and reads the scheduler's
through ``SchedulingView``, a read-only snapshot the scheduler passes per decision:

- per-request ``AcceptanceState`` for the configured proposal source, started from the
  population priors (ACC-5, ACC-18..20), preseedable (OPEN-34, VER-23);
- ``plan``: the ordinary winner competes with the best speculative round over every
  loaded ``(B, D, W, P)`` (``policy/rounds.py``, SPEC-6, SEL-24..34); a funded
  acceptance probe may then replace a measured ordinary winner
  (``policy/learning.py``, LRN-3..10); a timing refresh winner stays (LRN-7);
- ``check_commit``/``committed``: a probe opens an acceptance episode (LRN-8);
- ``check_completion``/``completed`` (QUEUE-3, QUEUE-4): acceptance ledger earn/charge
  (LRN-1, LRN-11, LRN-13), and every completed speculative lane's forecast and
  acceptance update (ACC-6..9, ACC-13, ACC-28, LRN-12). Device-allocated programs with
  ``D > 0`` need the round's confidence sidecar and each lane's evaluated draft count
  (``RoundCompletion``, QUEUE-3);
- ``on_idle`` clears positive acceptance credit and keeps debt (LRN-16);
- ``observe_counterfactual``: copy acceptance observed from frames that verified
  no copy drafts (flare's extension of ACC-9 for the copy source).

A funded timing refresh may also pick a stale speculative program and run one complete
round (REF-13, REF-14: the scheduler charges the refresh ledger its interval).

Wider mixed programs (``speculation_enabled``, ``W > 1``): their speculative decode rows
beside a prompt chunk are candidates too (``policy/mixed_rounds.py``, *Mixed execution
contract*), ranked against the winner by the same rule; their decode lanes learn
acceptance like a separate round's (MIX-30); a stale one may be the funded refresh
choice. Acceptance probes consider separate programs only. Width-one mixed programs of
a speculative load keep the draft context (MIX-6) and compete in ordinary selection.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from policy.catalog_index import CatalogIndex, ShapeTimes
from policy.client_shares import client_rate_views
from policy.config import PolicyConfig
from policy.credit_ledgers import (
    CreditLedger,
    acceptance_learning_ledger,
    settle_frame,
)
from policy.decision import projected_histories
from policy.decision_context import DecisionContext
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape, TargetBinding
from policy.duration_estimates import DurationEstimates
from policy.frame_queue import FrameQueue, QueuedFrame
from policy.learning import (
    find_probe,
    ordinary_from_plan,
    ordinary_from_round,
    round_observations,
)
from policy.mixed_rounds import best_mixed_round, mixed_round_plan, wider_mixed_shapes
from policy.protocol import Confidence, RoundCompletion
from policy.requests import RequestRecord
from policy.round_plans import round_plan, round_wins, speculative_lanes
from policy.round_table import LaneTable, SpeculativeLane, lane_table, observe_completed_round
from policy.rounds import RoundPrograms, SpeculationMode, rank_key, ranked_rounds, round_candidates
from policy.speculation import AcceptanceState, PopulationPriors, ProposalSource
from policy.types import (
    CommitRejected,
    CompletionError,
    DecodeMode,
    FinishKind,
    GeneratedToken,
    LaneRole,
    RequestHandle,
    ScheduledPlan,
    SelectionReason,
)

__all__ = ["RoundSpeculation", "SchedulingView", "SpeculationSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculationSettings:
    """How the scheduler speculates: its selection mode and proposal source."""

    mode: SpeculationMode = SpeculationMode.ADAPTIVE
    """Adaptive selection, or fixed widths with complete prefixes and no acceptance
    probes (LRN-10)."""
    source: ProposalSource = ProposalSource.LEARNED
    context_limit: int | None = None
    """Context positions a request may reach; bounds each lane's round depth."""
    depth_beyond: bool = False
    """Fold the depth-``(D + 1)`` observations a learned round's lanes report
    (``learning.round_observations``); off: the seed's ACC-9."""


class SchedulingView(NamedTuple):
    """The scheduler's state one decision reads (never written through)."""

    now_ns: int
    records: Mapping[RequestHandle, RequestRecord]
    queue: FrameQueue
    config: PolicyConfig
    catalog: CatalogIndex
    times: ShapeTimes
    estimates: DurationEstimates
    refresh_funded: bool


def _runs_rounds(plan: ScheduledPlan) -> bool:
    """Whether ``plan``'s decode lanes run speculative rounds: a complete speculative
    program, or a wider mixed program's speculative decode rows (MIX-30)."""
    mixed = plan.step.mixed
    return plan.shape.kind is GraphKind.SPECULATIVE or (
        mixed is not None and mixed.decode_mode is DecodeMode.SPECULATIVE)


def _device_allocated(shape: GraphShape) -> bool:
    """A program whose target rows the device allocates from the confidence sidecar."""
    return shape.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT and shape.proposal_depth > 0


class _SpeculativeCatalog(NamedTuple):
    catalog: object
    pairs: list[tuple[GraphShape, int]]
    programs: RoundPrograms
    program_positions: list[int]
    mixed: list[GraphShape]
    """Wider speculative mixed programs (``policy/mixed_rounds.py``)."""
    mixed_positions: list[int]
    mixed_rows: int
    """The widest wider mixed program's ``W`` (0 without one)."""


class RoundSpeculation:
    """Acceptance state, round planning and round completion of one scheduler."""

    def __init__(self, settings: SpeculationSettings) -> None:
        self.settings = settings
        self._priors = PopulationPriors()
        self._states: dict[RequestHandle, AcceptanceState] = {}
        self._learning: CreditLedger = acceptance_learning_ledger()
        self._positions_cache: _SpeculativeCatalog | None = None

    # ---- acceptance state ----------------------------------------------------------

    @property
    def learning_ledger(self) -> CreditLedger:
        return self._learning

    @property
    def mode(self) -> SpeculationMode:
        return self.settings.mode

    def acceptance(self, handle: RequestHandle) -> AcceptanceState:
        """The request's acceptance state (created from the population priors); the
        scheduler checks residency first."""
        state = self._states.get(handle)
        if state is None:
            state = self._states[handle] = AcceptanceState(self._priors)
        return state

    def preseed(self, handle: RequestHandle, means: Sequence[float], weight: float) -> None:
        self.acceptance(handle).preseed(self.settings.source, means, weight)

    def observe_counterfactual(self, handle: RequestHandle, *, resident: bool, offered: int,
                               accepted: int, terminated: bool,
                               survival: Sequence[float] | None) -> None:
        """Fold a *counterfactual* round of the configured proposal source into the
        request's acceptance and the population prior, with the seed's estimator
        (ACC-6..8, ACC-20). A request no longer ``resident`` still teaches the
        population prior.

        Copy proposals are a pure function of the request's own tokens (SPEC-8), so
        where a frame advanced the request without verifying copy drafts (a decode, a
        width-one round, a round whose lookup found nothing), the host can replay the
        lookup on the context that frame started from and compare the drafts with the
        tokens the target then produced: ``offered`` drafts, the first ``accepted`` of
        them equal to the following tokens. For greedy lanes that is exactly what the
        round would have accepted; for sampled lanes the match indicator has the
        round's acceptance probability as its expectation. ``terminated``: the request
        ended before the drafts were all compared (censoring, ACC-8). This is flare's
        extension of ACC-9 for the copy source (``docs/speculative-selection.md``,
        *Counterfactual copy rounds*): a real round's verification costs device time, a
        counterfactual costs a dictionary lookup, and without it a request whose first
        rounds failed re-learns copy acceptance only through 1 % probes.

        The learned source has depth-one counterfactuals: a width-one step that keeps
        the draft context feeds the draft the pending token, so the draft's greedy
        proposal for the next token is known; for a greedy request, whether it equals
        the emitted token is exactly what a depth-one round would have accepted
        (``offered = 1``). For a sampled request the step reports ``sum min(p, q)``,
        the probability a depth-one round would have accepted its draft: passed as
        ``survival``, it replaces the binary observation (ACC-28).
        """
        state = self.acceptance(handle) if resident else AcceptanceState(self._priors)
        state.observe_round(self.settings.source, offered=offered, accepted=accepted,
                            terminated=terminated, survival=survival)

    def release(self, handles: Sequence[RequestHandle]) -> None:
        for h in handles:
            self._states.pop(h, None)

    def on_idle(self) -> None:
        self._learning.on_idle()

    # ---- planning -------------------------------------------------------------------

    def _speculative_catalog(self, catalog: CatalogIndex) -> _SpeculativeCatalog:
        """Per catalog: the speculative (shape, position) pairs, their ``RoundPrograms``,
        each program's catalog position in ``RoundPrograms`` order, and the wider
        speculative mixed programs with their positions."""
        cached = self._positions_cache
        if cached is None or cached.catalog is not catalog:
            position = catalog.position
            pairs = [(s, position[s]) for s in catalog.shapes
                     if s.kind is GraphKind.SPECULATIVE]
            programs = RoundPrograms(s for s, _ in pairs)
            mixed = wider_mixed_shapes(catalog.shapes)
            cached = self._positions_cache = _SpeculativeCatalog(
                catalog, pairs, programs, [position[s] for s in programs.shapes],
                mixed, [position[s] for s in mixed],
                max((s.token_capacity for s in mixed), default=0))
        return cached

    def plan(self, ordinary: ScheduledPlan | None, ctx: DecisionContext,
             view: SchedulingView) -> ScheduledPlan | None:
        """The ordinary winner, a better speculative round, or a funded probe."""
        mode, config, now_ns = self.settings.mode, view.config, view.now_ns
        speculative = self._speculative_catalog(view.catalog)
        pairs, programs = speculative.pairs, speculative.programs
        program_positions = speculative.program_positions
        decoders = ctx.decoders.records
        if not pairs or not decoders:
            return ordinary
        times = view.times
        shapes = [s for s, _ in pairs]
        position = view.catalog.position
        known_ns = times.estimate_ns.tolist()
        program_estimates = [int(known_ns[i]) for i in program_positions]
        estimates = _LazyEstimates(pairs, known_ns)
        stale = times.stale(now_ns, view.estimates.ttl_ns)
        histories = projected_histories(view.records, view.queue, config) \
            if len(view.queue) else {}
        if config.client_fairness:
            histories = client_rate_views(view.records, histories, config)
        depth = max(s.proposal_depth for s in shapes)
        room = {}
        limit = self.settings.context_limit
        if limit is not None:
            room = {r.handle: limit - r.prompt_len - r.output_committed
                    - r.queued_outputs for r in decoders}
        lanes = speculative_lanes(
            decoders, histories=histories, states=self._states, priors=self._priors,
            source=self.settings.source, depth_limit=depth, context_room=room,
            config=config, exponent=ctx.exponent, age_slope=ctx.decoders.slope,
            start_ns=ctx.start_ns)
        alpha = config.adaptive_verification_alpha
        # one lane table serves the separate programs and the wider mixed ones
        table = lane_table(lanes, max(programs.max_rows, speculative.mixed_rows), alpha) \
            if speculative.mixed else None
        if ordinary is not None and ordinary.reason is SelectionReason.TIMING_REFRESH:
            # Refresh goes first (REF-7, LRN-7); a speculative program touched less
            # recently than the ordinary refresh choice takes its place (REF-8, REF-13).
            return self._speculative_refresh(ordinary, lanes, shapes, estimates, ctx,
                                             table, view) or ordinary
        ranked = ranked_rounds(lanes, programs, program_estimates, alpha=alpha,
                               waiting=ctx.waiting, mode=mode, limit=1, table=table)
        best = ranked[0] if ranked else None  # best first (rank_key)
        winner = ordinary
        won_round = None  # the winning round, when a speculative round won
        if best is not None and round_wins(best, ordinary):
            won_round = best
            winner = round_plan(
                best, exponent=ctx.exponent, stale=bool(stale[position[best.shape]]),
                reason=SelectionReason.ORDINARY if best.rate is not None
                else SelectionReason.DISCOVERY, now_ns=now_ns, start_ns=ctx.start_ns)
        if table is not None:
            mixed = best_mixed_round(
                table, ctx.prompts, speculative.mixed,
                [int(known_ns[i]) for i in speculative.mixed_positions],
                waiting=ctx.waiting)
            if mixed is not None and round_wins(mixed, winner):
                won_round = None
                winner = mixed_round_plan(
                    mixed, exponent=ctx.exponent, stale=bool(stale[position[mixed.shape]]),
                    reason=SelectionReason.ORDINARY if mixed.rate is not None
                    else SelectionReason.DISCOVERY, now_ns=now_ns,
                    start_ns=ctx.start_ns)
        if winner is None or winner.reason is not SelectionReason.ORDINARY:
            return winner
        if view.refresh_funded:
            refresh = self._speculative_refresh(winner, lanes, shapes, estimates, ctx, table,
                                                view)
            if refresh is not None:
                return refresh
        if mode is SpeculationMode.FIXED or not self._learning.funded():
            return winner  # find_probe offers nothing then (LRN-8, LRN-10)
        probe = find_probe(lanes=lanes, shapes=shapes, estimates_ns=estimates,
                           ordinary=ordinary_from_round(won_round) if won_round is not None
                           else ordinary_from_plan(winner), ledger=self._learning,
                           mode=mode, alpha=alpha, waiting=ctx.waiting,
                           refresh_pending=False)
        if probe is None:
            return winner
        return round_plan(probe.expected, reason=SelectionReason.ACCEPTANCE_LEARNING,
                          exponent=ctx.exponent,
                          stale=bool(stale[position[probe.expected.shape]]),
                          now_ns=now_ns, start_ns=ctx.start_ns)

    def _speculative_refresh(self, incumbent: ScheduledPlan, lanes: Sequence[SpeculativeLane],
                             shapes: Sequence[GraphShape], estimates: Mapping[GraphShape, int],
                             ctx: DecisionContext, table: LaneTable | None,
                             view: SchedulingView) -> ScheduledPlan | None:
        """A funded refresh of one stale speculative program: one complete captured
        round (REF-13), or a wider mixed program's frame (``table``: the decision's lane
        table when the catalog has them), the least recently touched stale program first
        (REF-8, OPEN-9), ties by its ordinary ranking (a separate round before a mixed
        frame touched at the same time). Only when it was touched before the incumbent's
        program when the incumbent is itself a refresh. None when no program qualifies."""
        times, now_ns = view.times, view.now_ns
        position = view.catalog.position
        stale = times.stale(now_ns, view.estimates.ttl_ns)  # implies a known estimate
        if not stale.any():  # the usual case: no shape hashed, no estimate dict built
            return None
        touched = times.last_touched_ns
        picks: list[tuple[int, ScheduledPlan]] = []
        eligible = [s for s in shapes if stale[position[s]] and s != incumbent.shape]
        cands = round_candidates(lanes, eligible, estimates,
                                 alpha=view.config.adaptive_verification_alpha,
                                 waiting=ctx.waiting, mode=self.settings.mode,
                                 keep_dominated=True) if eligible else []
        if cands:
            pick = min(cands, key=lambda c: (int(touched[position[c.shape]]), rank_key(c)))
            picks.append((int(touched[position[pick.shape]]), round_plan(
                pick, reason=SelectionReason.TIMING_REFRESH, exponent=ctx.exponent,
                stale=True, now_ns=now_ns, start_ns=ctx.start_ns)))
        if table is not None:
            mixed = sorted((s for s in self._speculative_catalog(view.catalog).mixed
                            if stale[position[s]] and s != incumbent.shape),
                           key=lambda s: int(touched[position[s]]))
            for shape in mixed:  # the oldest one that has a feasible frame
                candidate = best_mixed_round(table, ctx.prompts, [shape],
                                             [view.estimates.estimate_ns(shape)],
                                             waiting=ctx.waiting)
                if candidate is not None:
                    picks.append((int(touched[position[shape]]), mixed_round_plan(
                        candidate, reason=SelectionReason.TIMING_REFRESH,
                        exponent=ctx.exponent, stale=True, now_ns=now_ns,
                        start_ns=ctx.start_ns)))
                    break
        if not picks:
            return None
        mine, plan = min(picks, key=lambda p: p[0])
        if incumbent.reason is SelectionReason.TIMING_REFRESH \
                and mine >= int(touched[position[incumbent.shape]]):
            return None
        return plan

    # ---- commit -----------------------------------------------------------------------

    def check_commit(self, plan: ScheduledPlan) -> None:
        """Before any other commit check: a probe needs full credit and no open episode
        (LRN-8)."""
        if plan.reason is SelectionReason.ACCEPTANCE_LEARNING and not self._learning.funded():
            raise CommitRejected("acceptance probe without full credit or with an open episode")

    def committed(self, plan: ScheduledPlan) -> None:
        """A committed probe opens an acceptance episode (LRN-8)."""
        if plan.reason is SelectionReason.ACCEPTANCE_LEARNING:
            self._learning.begin_episode()

    # ---- completion -----------------------------------------------------------------

    @staticmethod
    def check_completion(shape: GraphShape, round: RoundCompletion | None) -> None:
        """Before anything changes: a device-allocated round completes only with its
        confidence sidecar and evaluated draft counts (QUEUE-3)."""
        if shape.kind is GraphKind.SPECULATIVE and _device_allocated(shape) \
                and (round is None or round.confidence is None):
            raise CompletionError("a device-allocated round completes with its confidence "
                                  "sidecar and evaluated draft counts (QUEUE-3)")

    def completed(self, head: QueuedFrame, out: Sequence[GeneratedToken],
                  timing: ExecutionTiming, round: RoundCompletion | None) -> None:
        """After the scheduler applied ``head``: the acceptance ledger and every
        completed speculative lane's forecast and acceptance."""
        settle_frame(self._learning, timing, isolated=head.isolated,
                     ordinary=head.reason is SelectionReason.ORDINARY,
                     episode=head.reason is SelectionReason.ACCEPTANCE_LEARNING)
        shape = head.plan.shape
        confidence: Confidence | None = None
        offered: Mapping[RequestHandle, int] | None = None
        survival: Mapping[RequestHandle, Sequence[float]] | None = None
        if round is not None:
            survival, offered = round_observations(round.lanes,
                                                   depth_beyond=self.settings.depth_beyond)
            if _device_allocated(shape):
                confidence = round.confidence
        rounds = _runs_rounds(head.plan)
        slots = {lane.handle: i for i, lane in enumerate(head.plan.lanes)}
        ceilings = {lane.handle: lane.token_ceiling for lane in head.plan.lanes}
        roles = {lane.handle: lane.role for lane in head.plan.lanes}
        for token in out:
            if token.finish is FinishKind.ERROR or not token.token_ids:
                continue
            state = self._states.get(token.handle)
            if state is None:
                state = self._states[token.handle] = AcceptanceState(self._priors)
            if rounds and roles[token.handle] is LaneRole.DECODE:
                self._observe(state, shape, token, slots[token.handle],
                              ceilings[token.handle], confidence, offered, survival)
            state.age(len(token.token_ids))

    def _observe(self, state: AcceptanceState, shape: GraphShape, token: GeneratedToken,
                 slot: int, ceiling: int, confidence: Confidence | None,
                 offered: Mapping[RequestHandle, int] | None,
                 survival: Mapping[RequestHandle, Sequence[float]] | None) -> None:
        drafts = offered.get(token.handle, 0) if offered is not None else ceiling - 1
        accepted = len(token.token_ids) - 1
        if drafts < 0 or accepted > drafts:
            return  # not a verified round the estimates can read
        joint = None
        if confidence is not None and shape.proposal_depth > 0:
            joint = list(confidence[1][slot])
        observe_completed_round(
            state, self.settings.source, shape, joint_prefix=joint, offered=drafts,
            accepted=accepted, terminated=token.finish is FinishKind.STOP,
            survival=survival.get(token.handle) if survival is not None else None)


class _LazyEstimates(Mapping[GraphShape, int]):
    """Each speculative program's estimate by shape, built into a dict only when a
    refresh or probe reads it (hashing every shape per decision is measurable)."""

    def __init__(self, pairs: Sequence[tuple[GraphShape, int]], known_ns: Sequence[int]
                 ) -> None:
        self._pairs = pairs
        self._known = known_ns
        self._dict: dict[GraphShape, int] | None = None

    def _built(self) -> dict[GraphShape, int]:
        if self._dict is None:
            known = self._known
            self._dict = {s: int(known[i]) for s, i in self._pairs}
        return self._dict

    def __getitem__(self, shape: GraphShape) -> int:
        return self._built()[shape]

    def __iter__(self) -> Iterator[GraphShape]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._pairs)
