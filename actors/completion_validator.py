"""completion-validator: checks every lane of a finished frame before anything changes.

Architecture step 5; seed *Service accounting and publication* ("complete validates
every lane before updating graph costs, acceptance, service prices, or committed
state", ACCT-6). ``check_frame`` is the pure decision; ``run`` is the actor:

- for each lane: the sample belongs to the lane's state row (handle), the lane's
  epoch is the one committed, the token id lies in the vocabulary, the sampled lane
  count stays within the lane's ceiling, the log-probability is finite (and not
  positive) and the program's finite flag holds;
- a speculative lane (``SpeculativeResult``): the lane's row, an accepted prefix
  within its ceiling and the program's ``P`` (``accepted <= evaluated < ceiling``,
  emitted ``accepted + 1`` tokens, target rows within ``P`` in total), every token in
  the vocabulary with a finite, non-positive log-probability, every drafted token in
  the vocabulary, every survival product and the lane's confidence estimates (its slot
  of the round's sidecar) probabilities in [0, 1] (ACC-15); the burst is cut after
  its first EOS/stop token. However many tokens it carries, a lane's burst is one
  delivery (the publisher sends it as one event);
- a mixed frame with speculative decode rows (``SpeculativeMixedResult``; seed *Mixed
  execution contract*, MIX-26): each lane by its phase, in plan order. The prompt
  lane commits its chunk and, when the chunk ends the prompt, needs a valid first
  token (checked like any sample, MIX-28); each decode lane is checked and cut exactly
  like a speculative round's lane (MIX-29), and the chunk plus the decode lanes'
  target rows stay within ``P``. The valid decode lanes' rounds go to completion as
  a speculative round's do;
- a tensor-parallel group's completion (peer ranks' outputs beside rank zero's):
  ranks that disagree on identities, consumption or emitted tokens reject the frame
  (ACC-16); a peer's confidence estimates must be probabilities (ACC-15); rank zero's
  values are the ones kept (ACC-14) (``actors.rank_agreement``);
- a malformed lane fails only its own request (``ok=False`` with a message); a
  program fault fails every lane of its frame with the fault's message;
- a grammar-constrained lane (structured output) advances its matcher with each valid
  token; a token the grammar refuses fails the lane, and a token that completes the
  grammar terminates the request like an EOS (``actors.grammar``);
- it then retires the fence at the checkpoint-allocator *before* handing the
  validated frame to the planner, so anything the planner releases in response sees
  the fence as retired (PRE-53).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import trio

from actors.frame_inputs import runs_speculative_mixed
from actors.messages import (
    AllocatorInbox,
    FenceRetired,
    FrameOrder,
    FrameOutcome,
    LaneContext,
    LaneFailure,
    PlannerInbox,
    RoundLane,
    SpeculativeRounds,
    ValidatedFrame,
    ValidatorInbox,
)
from actors.rank_agreement import disagreement, peer_confidence_problem, peer_results
from gpu import (
    Alternatives,
    LaneSample,
    SpeculativeLane,
    SpeculativeMixedResult,
    SpeculativeResult,
    StepResult,
    result_of,
    speculative_result_of,
)
from policy import CompletionRecord, ExecutionTiming, GraphKind, Lane, LaneRole, RequestHandle

LOGPROB_TOLERANCE = 1e-4
"""A log-probability above this is malformed (float rounding can give tiny positives)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameCheck:
    records: tuple[CompletionRecord, ...]
    failures: tuple[LaneFailure, ...]
    logprobs: tuple[tuple[float, ...], ...]
    prompt_logprobs: tuple[float, ...] | None
    top_logprobs: tuple[tuple[Alternatives, ...], ...] = ()
    """Per lane, per token of ``logprobs``: the program's top alternatives."""
    prompt_top_logprobs: tuple[Alternatives, ...] | None = None
    rounds: SpeculativeRounds | None = None
    draft_proposals: tuple[tuple[RequestHandle, int], ...] = ()
    """Valid lanes whose width-one step reported the learned draft's greedy proposal."""
    draft_acceptances: tuple[tuple[RequestHandle, float], ...] = ()
    """Valid lanes whose width-one step reported a depth-one draft's acceptance
    probability (sampled lanes, ``LaneSample.draft_acceptance``)."""


def _failed(lanes: tuple[Lane, ...], message: str) -> FrameCheck:
    return FrameCheck(
        records=tuple(CompletionRecord(handle=lane.handle, epoch=lane.epoch, ok=False)
                      for lane in lanes),
        failures=tuple(LaneFailure(handle=lane.handle, epoch=lane.epoch, message=message)
                       for lane in lanes),
        logprobs=tuple(() for _ in lanes),
        prompt_logprobs=None,
        top_logprobs=tuple(() for _ in lanes),
    )


@dataclass(slots=True)
class _LaneRecords:
    """A frame's per-lane outcome, built lane by lane in plan order."""

    vocab_size: int
    records: list[CompletionRecord] = field(default_factory=list)
    failures: list[LaneFailure] = field(default_factory=list)
    logprobs: list[tuple[float, ...]] = field(default_factory=list)
    top_logprobs: list[tuple[Alternatives, ...]] = field(default_factory=list)
    rounds: list[RoundLane] = field(default_factory=list)
    proposals: list[tuple[RequestHandle, int]] = field(default_factory=list)
    acceptances: list[tuple[RequestHandle, float]] = field(default_factory=list)

    def fail(self, lane: Lane, problem: str) -> None:
        """Record one malformed lane: it fails alone, with a clear message."""
        self.records.append(CompletionRecord(handle=lane.handle, epoch=lane.epoch, ok=False))
        self.failures.append(LaneFailure(handle=lane.handle, epoch=lane.epoch,
                                         message=f"malformed completion: {problem}"))
        self.logprobs.append(())
        self.top_logprobs.append(())

    def sampled(self, lane: Lane, context: LaneContext, sample: LaneSample | None,
                problem: str | None = None) -> None:
        """A lane that sampled at most one token: checked (identity, the sample, a
        ceiling of at least one for a sample) and recorded, or failed alone with its
        first problem (``problem``: the caller's own finding)."""
        problem = _sampled_problem(lane, context, sample, self.vocab_size) or problem
        tokens: tuple[int, ...] = (sample.token,) if sample is not None else ()
        problem = problem or _grammar_problem(context, tokens)
        if problem is not None:
            self.fail(lane, problem)
            return
        self.records.append(CompletionRecord(
            handle=lane.handle, epoch=lane.epoch, token_ids=tokens,
            prompt_tokens=lane.prompt_tokens if lane.role is LaneRole.PROMPT else 0,
            terminated=any(t in context.eos_token_ids for t in tokens)
            or _grammar_complete(context, tokens),
        ))
        self.logprobs.append((sample.logprob,) if sample is not None else ())
        self.top_logprobs.append((sample.top_logprobs,) if sample is not None else ())
        if sample is not None and 0 <= sample.draft_proposal < self.vocab_size:
            self.proposals.append((lane.handle, sample.draft_proposal))
        if sample is not None and 0.0 <= sample.draft_acceptance <= 1.0:  # NaN fails
            self.acceptances.append((lane.handle, sample.draft_acceptance))

    def speculative(self, lane: Lane, context: LaneContext, spec: SpeculativeLane,
                    problem: str | None = None) -> None:
        """A speculative lane: checked against its ceiling, its burst cut after the
        first EOS/stop token, its round kept for completion (``problem``: the caller's
        own finding)."""
        problem = _identity_problem(lane, context) or _lane_problem(
            spec, context, lane.token_ceiling, self.vocab_size) or problem
        stop = next((i for i, t in enumerate(spec.tokens) if t in context.eos_token_ids),
                    None)
        count = len(spec.tokens) if stop is None else stop + 1
        problem = problem or _grammar_problem(context, spec.tokens[:count])
        if problem is not None:
            self.fail(lane, problem)
            return
        self.records.append(CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                             token_ids=spec.tokens[:count],
                                             terminated=stop is not None))
        self.logprobs.append(spec.logprobs[:count])
        self.top_logprobs.append(spec.top_logprobs[:count])
        beyond = spec.beyond if 0.0 <= spec.beyond <= 1.0 else -1.0  # NaN: none
        # within rounding of [0, 1] (checked): clamped so the estimates see probabilities
        survival = tuple(min(max(v, 0.0), 1.0) for v in spec.survival)
        self.rounds.append(RoundLane(handle=lane.handle, proposed=spec.proposed,
                                     evaluated=spec.evaluated, accepted=spec.accepted,
                                     survival=survival, beyond=beyond))
        if 0 <= spec.draft_proposal < self.vocab_size:
            self.proposals.append((lane.handle, spec.draft_proposal))
        if 0.0 <= spec.draft_acceptance <= 1.0:  # NaN fails
            self.acceptances.append((lane.handle, spec.draft_acceptance))

    def check(self, *, prompt_logprobs: tuple[float, ...] | None = None,
              prompt_top_logprobs: tuple[Alternatives, ...] | None = None,
              confidence: np.ndarray | None = None) -> FrameCheck:
        """The frame's check; ``confidence`` (the round's sidecar) marks a frame with
        speculative rounds."""
        rounds = None
        if confidence is not None:
            rounds = SpeculativeRounds(
                confidence=tuple(tuple(tuple(float(v) for v in row) for row in plane)
                                 for plane in confidence),
                lanes=tuple(self.rounds))
        return FrameCheck(records=tuple(self.records), failures=tuple(self.failures),
                          logprobs=tuple(self.logprobs), prompt_logprobs=prompt_logprobs,
                          top_logprobs=tuple(self.top_logprobs),
                          prompt_top_logprobs=prompt_top_logprobs,
                          rounds=rounds, draft_proposals=tuple(self.proposals),
                          draft_acceptances=tuple(self.acceptances))


def _grammar_problem(context: LaneContext, tokens: tuple[int, ...]) -> str | None:
    """Advance the lane's grammar past ``tokens`` (valid samples, in order): the first
    one it refuses is a problem (the program ran without the lane's mask)."""
    grammar = context.grammar
    if grammar is None:
        return None
    for token in tokens:
        if not grammar.accept(token):
            return f"token {token} is outside the request's grammar ({grammar.error})"
    return None


def _grammar_complete(context: LaneContext, tokens: tuple[int, ...]) -> bool:
    """The lane's grammar is complete after ``tokens``: its request ends (``stop``)."""
    return bool(tokens) and context.grammar is not None and context.grammar.complete


def _identity_problem(lane: Lane, context: LaneContext) -> str | None:
    if (context.handle, context.epoch) != (lane.handle, lane.epoch):
        return "lane identity does not match the committed plan"
    return None


def _sampled_problem(lane: Lane, context: LaneContext, sample: LaneSample | None,
                     vocab_size: int) -> str | None:
    problem = _identity_problem(lane, context)
    if problem is None and sample is not None:
        problem = _sample_problem(sample, context, vocab_size)
        if problem is None and lane.token_ceiling < 1:
            problem = "output beyond the lane's ceiling"
    return problem


def _sample_problem(sample: LaneSample, context: LaneContext, vocab_size: int) -> str | None:
    if sample.row != context.row:
        return f"sample for state row {sample.row}, expected row {context.row}"
    if not 0 <= sample.token < vocab_size:
        return f"token id {sample.token} outside the vocabulary (size {vocab_size})"
    if not sample.finite or not math.isfinite(sample.logprob):
        return "non-finite logits or log-probability"
    if sample.logprob > LOGPROB_TOLERANCE:
        return f"log-probability {sample.logprob} is positive"
    return None


def check_frame(order: FrameOrder, outcome: FrameOutcome, *, vocab_size: int) -> FrameCheck:
    """Validate every lane of ``order`` against what the device returned."""
    lanes = order.plan.lanes
    if outcome.fault is not None:
        return _failed(lanes, f"program fault: {outcome.fault}")
    if outcome.completion is None:
        return _failed(lanes, "the frame returned no completion")
    outputs = outcome.completion.outputs
    speculative = order.plan.shape.kind is GraphKind.SPECULATIVE
    mixed = not speculative and runs_speculative_mixed(order.plan)
    read = speculative_result_of if speculative or mixed else result_of
    try:
        result, peers = read(outputs), peer_results(outputs, read)
    except (KeyError, TypeError) as exc:
        return _failed(lanes, f"malformed outputs: {exc}")
    disagreeing = disagreement(result, peers)
    if disagreeing is not None:  # ACC-16: which rank is right is unknowable
        return _failed(lanes, f"ranks disagree: {disagreeing}")
    if speculative:
        return check_speculative(order, result, vocab_size=vocab_size, peers=peers)
    if mixed:
        return check_speculative_mixed(order, result, vocab_size=vocab_size)
    samples: tuple[LaneSample, ...] = ()
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top: tuple[Alternatives, ...] | None = None
    if isinstance(result, StepResult):
        samples = result.samples
        prompt_logprobs, prompt_top = result.prompt_logprobs, result.prompt_top_logprobs
    sampling = [i for i, ctx in enumerate(order.lanes) if ctx.samples]
    if len(samples) != len(sampling):
        # Which sample belongs to which lane is unknowable: fail the whole frame.
        return _failed(lanes, f"{len(samples)} samples for {len(sampling)} sampling lanes")
    by_lane = dict(zip(sampling, samples, strict=True))
    out = _LaneRecords(vocab_size)
    for index, (lane, context) in enumerate(zip(lanes, order.lanes, strict=True)):
        out.sampled(lane, context, by_lane.get(index))
    if prompt_logprobs is not None and not all(
        math.isfinite(v) for v in prompt_logprobs[:-1]
    ):
        return _failed(lanes, "non-finite prompt log-probabilities")
    return out.check(prompt_logprobs=prompt_logprobs, prompt_top_logprobs=prompt_top)


def _lane_problem(spec: SpeculativeLane, context: LaneContext, ceiling: int,
                  vocab_size: int) -> str | None:
    if spec.row != context.row:
        return f"round for state row {spec.row}, expected row {context.row}"
    if not 0 <= spec.accepted <= spec.evaluated < max(ceiling, 1) or spec.proposed < 0:
        return (f"accepted {spec.accepted} of {spec.evaluated} verified drafts outside the "
                f"lane's ceiling {ceiling}")
    if len(spec.tokens) != spec.accepted + 1 or len(spec.logprobs) != len(spec.tokens):
        return f"{len(spec.tokens)} tokens for {spec.accepted} accepted drafts"
    if not spec.finite:
        return "non-finite logits"
    for token, logprob in zip(spec.tokens, spec.logprobs, strict=True):
        if not 0 <= token < vocab_size:
            return f"token id {token} outside the vocabulary (size {vocab_size})"
        if not math.isfinite(logprob):
            return "non-finite log-probability"
        if logprob > LOGPROB_TOLERANCE:
            return f"log-probability {logprob} is positive"
    if any(not 0 <= token < vocab_size for token in spec.drafts):
        return f"a drafted token id outside the vocabulary (size {vocab_size})"
    if not _probabilities(spec.survival):
        return "survival outside [0, 1]"
    return None


def _probabilities(values: Iterable[float]) -> bool:
    """Every value a probability, up to float rounding (NaN fails)."""
    return all(-LOGPROB_TOLERANCE <= v <= 1.0 + LOGPROB_TOLERANCE for v in values)


def _confidence_problem(confidence: np.ndarray, slot: int) -> str | None:
    """Slot ``slot`` of a round's ``[2, B, D]`` confidence sidecar (ACC-15)."""
    if confidence.ndim != 3 or slot >= confidence.shape[1]:
        return None  # no per-slot estimates to check
    if not _probabilities(float(v) for v in confidence[:, slot, :].ravel()):
        return "confidence estimate outside [0, 1]"
    return None


def check_speculative(order: FrameOrder, result: object, *, vocab_size: int,
                      peers: tuple[object, ...] = ()) -> FrameCheck:
    """Validate a complete speculative round lane by lane (VER-28, SPEC-19, SPEC-22);
    ``peers``: the other ranks' rounds, whose confidence estimates must be
    probabilities too (ACC-15). Rank zero's round is the one kept (ACC-14)."""
    lanes = order.plan.lanes
    if not isinstance(result, SpeculativeResult) or len(result.lanes) != len(lanes):
        return _failed(lanes, "a speculative frame returned no round for every lane")
    shape = order.plan.shape
    if sum(spec.target_rows for spec in result.lanes) > shape.packed_capacity:
        return _failed(lanes, f"target rows exceed P={shape.packed_capacity}")
    out = _LaneRecords(vocab_size)
    confidence = np.asarray(result.confidence)
    for slot, (lane, context, spec) in enumerate(
            zip(lanes, order.lanes, result.lanes, strict=True)):
        out.speculative(lane, context, spec, _confidence_problem(confidence, slot)
                        or peer_confidence_problem(peers, slot, _confidence_problem))
    return out.check(confidence=result.confidence)


def check_speculative_mixed(order: FrameOrder, result: object, *,
                            vocab_size: int) -> FrameCheck:
    """Validate a mixed frame with speculative decode rows lane by lane, each by its
    phase (MIX-26, MIX-28, MIX-29, VER-28): the prompt lane like a sampled lane (a
    first token exactly when its chunk ends the prompt), the decode lanes like a
    speculative round's, in plan order. Whatever cannot be attributed to one lane (no
    result, a round missing, a first token without a prompt lane, the chunk plus the
    target rows beyond ``P``) fails the frame."""
    lanes = order.plan.lanes
    if not isinstance(result, SpeculativeMixedResult) \
            or not isinstance(result.speculative, SpeculativeResult):
        return _failed(lanes, "a speculative mixed frame returned no result")
    prompt = [lane for lane in lanes if lane.role is LaneRole.PROMPT]
    rounds = result.speculative.lanes
    if len(prompt) > 1:
        return _failed(lanes, f"{len(prompt)} prompt lanes in one mixed frame")
    if len(rounds) != len(lanes) - len(prompt):
        return _failed(lanes, f"{len(rounds)} rounds for {len(lanes) - len(prompt)} "
                              "decode lanes")
    if result.prompt_sample is not None and not prompt:
        return _failed(lanes, "a first token without a prompt lane")
    shape = order.plan.shape
    chunk = prompt[0].prompt_tokens if prompt else 0
    if chunk + sum(spec.target_rows for spec in rounds) > shape.packed_capacity:
        return _failed(lanes, f"the prompt chunk and target rows exceed "
                              f"P={shape.packed_capacity}")
    out = _LaneRecords(vocab_size)
    decode = iter(rounds)
    for lane, context in zip(lanes, order.lanes, strict=True):
        if lane.role is not LaneRole.PROMPT:
            out.speculative(lane, context, next(decode))
            continue
        sample = result.prompt_sample
        problem = None
        if sample is None and context.samples:
            problem = "the prompt's last chunk returned no first token"
        elif sample is not None and not context.samples:
            problem = "a first token before the prompt's last chunk"
        out.sampled(lane, context, sample, problem)
    return out.check(confidence=result.speculative.confidence)


def zero_timing(wall_ns: int) -> ExecutionTiming:
    """Timing of a faulted frame: no device interval (DUR-19: changes no estimate)."""
    return ExecutionTiming(device_intervals_ns=(0,), wall_ns=wall_ns)


async def run(
    inbox: trio.MemoryReceiveChannel[ValidatorInbox],
    to_planner: trio.MemorySendChannel[PlannerInbox],
    to_allocator: trio.MemorySendChannel[AllocatorInbox],
    *,
    vocab_size: int,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Validate frames in completion order until the dispatcher closes the inbox."""
    async with inbox, to_planner, to_allocator:
        task_status.started()
        async for outcome in inbox:
            order = outcome.order
            check = check_frame(order, outcome, vocab_size=vocab_size)
            timing = (outcome.completion.timing if outcome.completion is not None
                      else zero_timing(outcome.wall_ns))
            await to_allocator.send(FenceRetired(
                fence=order.fence, failed=tuple(f.handle for f in check.failures)))
            await to_planner.send(ValidatedFrame(
                fence=order.fence, plan=order.plan, records=check.records,
                failures=check.failures, timing=timing, logprobs=check.logprobs,
                prompt_logprobs=check.prompt_logprobs, top_logprobs=check.top_logprobs,
                prompt_top_logprobs=check.prompt_top_logprobs,
                fault=str(outcome.fault) if outcome.fault is not None else None,
                launched_ns=outcome.launched_ns,
                observed_ns=outcome.launched_ns + outcome.wall_ns,
                rounds=check.rounds, draft_proposals=check.draft_proposals,
                draft_acceptances=check.draft_acceptances,
            ))
