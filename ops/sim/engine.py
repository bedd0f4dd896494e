"""The discrete-event simulator behind ``flare sim``: real policy code, simulated device.

``simulate(planner, requests, costs, options)`` drives any
``policy.protocol.SchedulingPolicy`` (the seed's ``Scheduler`` or a baseline) exactly as the runtime's planner does -- ``advance_to``,
``plan``, ``window_ready``, ``commit``, ``complete``, ``published_output``,
``take_released`` -- while a simulated device runs each committed frame for the cost
table's duration. Events are request arrivals and frame completions; nothing else moves
the clock, so results depend only on the inputs and the seed.

Runtime semantics reproduced:

* admission: arrivals wait in a FIFO (or another ``admission`` order,
  ``ops.sim.admission``) and become resident while fewer than ``max_resident`` requests
  are resident (the runtime's row/page grant); with
  ``max_queue`` set, an arrival finding that many waiting is refused (status "error");
* two frame slots: after every event the simulator commits plans while the policy's
  window accepts them (a frame is queued behind another only when the policy's plan
  allows it); a frame committed into an empty window starts ``dispatch_ns`` after its
  commit, a queued one starts when its predecessor ends, or ``dispatch_ns`` after its
  commit if that is later, so queueing hides the host gap as on the real device;
* completion: frames complete in order at start + duration; every lane gets a
  well-formed ``CompletionRecord`` (one token per decode lane and per final prompt
  chunk; ``terminated`` when a request reaches its target output length, the
  simulated EOS); ``ExecutionTiming`` carries the duration as the device interval and
  commit-to-completion as wall time;
* publication: each returned burst is published at the completion time (reported to
  the policy with ``published_output``) and becomes one streamed chunk of the request's
  ``ops.loadgen.records.RequestRecord``, so the load benchmark's metrics apply as is;
* speculative rounds (host-allocated ``QueryLength`` programs; a lane's ``token_ceiling``
  is its host length of ``r`` target rows, ``r - 1`` drafts): the lane emits its
  accepted draft prefix plus one token, cut at the request's target length (the
  simulated EOS). Acceptance is a property of the text position, drawn with common
  random numbers: request ``i`` has one uniform ``u_j`` per output position ``j`` from a
  generator seeded with ``(seed, i)``, and the draft proposing output token ``j`` is
  accepted when ``u_j < a_i`` (``RequestPlan.acceptance``). A round starting at output
  position ``p`` accepts the leading run of accepted positions ``p, p+1, ...``, at most
  ``r - 1``: a geometric prefix with ``P(accepted >= m) = a**m``, and every policy sees
  the same draws for the same request. Device-allocated programs are not simulated.

Image prompts (``SimOptions.vision``, ``ops.sim.vision``): requests are admitted with
their image plan, so chunks follow the policy's window and atomic-span rules, and a
prompt frame's duration includes encoding its active window's new images.

Options: ``output_limit`` is the ``max_tokens`` a request is admitted with (at least its
target; 0 admits exactly the target, so requests end by length, not EOS);
``warm_estimates`` preloads each shape's mean into the policy's duration estimates at
time 0 (what a server knows after warm-up; off: the seed's scheduler discovers every
shape online); ``draft_counterfactuals`` gives a policy that learns acceptance the
learned draft's counterfactual observations that ``flare run`` reports
(``actors.planner``, ``docs/speculative-selection.md``): a width-one step at output
position ``p`` observes whether a depth-one round would have accepted (``u_p < a``),
and a round of ``D`` drafts also reports depth ``D + 1`` (held when the run from ``p``
reaches ``D + 1``), whatever it accepted (``RoundLaneOutcome.beyond``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ops.loadgen.records import RequestRecord
from ops.loadgen.workload import RequestPlan
from ops.sim.admission import AdmissionQueue
from ops.sim.costs import CostTable
from ops.sim.vision import VisionLoad, VisionWork
from ops.sim.workloads import DEFAULT_ACCEPTANCE
from policy.descriptors import ExecutionTiming, GraphKind, TargetBinding
from policy.protocol import RoundCompletion, RoundLaneOutcome, SchedulingPolicy
from policy.types import (
    CompletionRecord,
    Fence,
    FinishKind,
    LaneRole,
    RequestHandle,
    ScheduledPlan,
)

NS_PER_S = 1_000_000_000
PREFILL_KINDS = (GraphKind.PREFILL, GraphKind.SCORED_PREFILL)
TOKEN_ID = 7
"""Every simulated output token carries this id (content never matters to policy)."""
ACCEPTANCE_DRAWS = 0xD5AF
"""Mixed into each request's acceptance-draw seed (independent of the duration noise)."""
_TOKENS = tuple((TOKEN_ID,) * n for n in range(65))


@dataclass(frozen=True, slots=True, kw_only=True)
class SimOptions:
    max_resident: int = 64
    max_queue: int | None = None
    dispatch_ns: int = 50_000
    output_limit: int = 2048
    noise: float = 0.0
    warm_estimates: bool = True
    seed: int = 0
    horizon_s: float | None = None
    """Stop at this simulated time; unfinished requests are reported as cancelled."""
    draft_counterfactuals: bool = False
    """Learned-draft counterfactual observations for a policy that learns acceptance
    (module docstring); off: real rounds only (the seed's ACC-9)."""
    vision: VisionLoad = field(default_factory=VisionLoad)
    """Images in every prompt and the vision program's cost (``ops.sim.vision``)."""
    admission: str = "fifo"
    """Which waiting request becomes resident next (``ops.sim.admission``)."""

    def to_json(self) -> dict[str, Any]:
        return {"max_resident": self.max_resident, "max_queue": self.max_queue,
                "dispatch_ns": self.dispatch_ns, "output_limit": self.output_limit,
                "noise": self.noise, "warm_estimates": self.warm_estimates,
                "seed": self.seed, "horizon_s": self.horizon_s,
                "draft_counterfactuals": self.draft_counterfactuals,
                "vision": self.vision.to_json(), "admission": self.admission}


@dataclass(slots=True)
class _Flight:
    fence: Fence
    plan: ScheduledPlan
    commit_ns: int
    start_ns: int
    end_ns: int


@dataclass(slots=True)
class _Req:
    plan: RequestPlan
    arrival_ns: int
    handle: RequestHandle | None = None
    produced: int = 0
    """Tokens the simulated device produced for it (including discarded ones)."""
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish: FinishKind | None = None
    refused: bool = False
    plain_record: CompletionRecord | None = None
    """The reusable record of a one-token, non-final output lane."""
    accept_runs: np.ndarray | None = None
    """``accept_runs[j]``: consecutive accepted draft positions from output position j."""
    admitted_s: float | None = None
    released_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """One policy's simulated run."""

    records: tuple[RequestRecord, ...]
    makespan_s: float
    frames: dict[str, int]
    """Committed frames by program kind."""
    busy_s: float
    """Device time spent executing frames."""
    padding: dict[str, float]
    """Over all frames: fraction of request rows and of prompt capacity left unused."""
    plan_calls: int
    speculation: dict[str, int]
    """Speculative rounds run, lanes in them, drafts verified, drafts accepted."""
    wall_s: float
    """Host seconds the simulation itself took."""
    cpu_s: float
    """Process CPU seconds it took (robust to a shared machine)."""
    unfinished: int
    vision: dict[str, Any] = field(default_factory=dict)
    """Images the simulated vision program encoded and its device time (with images)."""
    slots: dict[str, float] = field(default_factory=dict)
    """Mean resident requests (running slots held) by stage: ``prompt`` (admitted, no
    token yet), ``streaming`` (first to last token), ``retiring`` (last token to release)."""

    def stats_json(self) -> dict[str, Any]:
        return {"makespan_s": self.makespan_s, "frames": self.frames, "busy_s": self.busy_s,
                "utilization": self.busy_s / self.makespan_s if self.makespan_s else 0.0,
                "padding": self.padding, "plan_calls": self.plan_calls,
                "speculation": {**self.speculation, "acceptance_rate":
                                self.speculation["accepted"] / self.speculation["drafted"]
                                if self.speculation["drafted"] else None},
                "simulation_wall_s": self.wall_s, "simulation_cpu_s": self.cpu_s, "unfinished": self.unfinished,
                "slots": self.slots, **({"vision": self.vision} if self.vision else {})}


def _slot_occupancy(reqs: Sequence[_Req], makespan_s: float) -> dict[str, float]:
    """``SimResult.slots``: each stage's slot-seconds over the makespan."""
    held = {"prompt": 0.0, "streaming": 0.0, "retiring": 0.0}
    for q in reqs:
        if q.admitted_s is None or q.released_s is None or not q.chunk_times_s:
            continue
        first, last = q.chunk_times_s[0], q.chunk_times_s[-1]
        held["prompt"] += first - q.admitted_s
        held["streaming"] += last - first
        held["retiring"] += q.released_s - last
    return {k: v / makespan_s if makespan_s > 0 else 0.0 for k, v in held.items()}


def _drains(plan: ScheduledPlan) -> bool:
    """Whether ``plan`` keeps every later frame out of the window until it completes."""
    return plan.requires_empty_window or not plan.shape.is_generation


class SimulationError(RuntimeError):
    """The policy stopped making progress while requests remained."""


def simulate(planner: SchedulingPolicy, requests: Sequence[RequestPlan], costs: CostTable,
             options: SimOptions | None = None) -> SimResult:
    """Run ``requests`` through ``planner`` on the simulated device."""
    return _Simulation(planner, requests, costs, options or SimOptions()).run()


class _Simulation:
    def __init__(self, planner: SchedulingPolicy, requests: Sequence[RequestPlan], costs: CostTable,
                 options: SimOptions) -> None:
        self.p = planner
        self.costs = costs
        self.o = options
        self.rng = np.random.default_rng(options.seed)
        self.reqs = [_Req(r, round(r.arrival_s * NS_PER_S)) for r in requests]
        self.reqs.sort(key=lambda q: q.arrival_ns)
        self.by_handle: dict[RequestHandle, _Req] = {}
        self.waiting: AdmissionQueue[_Req] = AdmissionQueue(options.admission, costs)
        self.flights: deque[_Flight] = deque()
        self.resident = 0
        self.fence = 0
        self.now = 0
        self.frames: dict[str, int] = {}
        self.busy_ns = 0
        self.rows = [0, 0]  # used, capacity
        self.prompt = [0, 0]
        self.plan_calls = 0
        self.finishing = 0
        """Requests that finished output and were not released yet."""
        self.speculation = {"rounds": 0, "lanes": 0, "drafted": 0, "accepted": 0}
        self.vision = VisionWork(options.vision)
        self.counterfactuals = options.draft_counterfactuals and planner.learns_acceptance
        """Whether the planner takes learned counterfactual observations."""

    def run(self) -> SimResult:
        started = time.perf_counter()
        cpu_started = time.process_time()
        if self.o.warm_estimates:
            for shape, mean in self.costs.mean_ns.items():
                self.p.estimates.observe(shape, mean, 0)
        horizon = math.inf if self.o.horizon_s is None else self.o.horizon_s * NS_PER_S
        nxt = 0
        while True:
            t_arrival = self.reqs[nxt].arrival_ns if nxt < len(self.reqs) else math.inf
            t_done = self.flights[0].end_ns if self.flights else math.inf
            t = min(t_arrival, t_done)
            if t == math.inf or t > horizon:
                break
            self.now = int(t)
            self.p.advance_to(self.now)
            if t_done <= t_arrival:
                self._complete()
            else:
                while nxt < len(self.reqs) and self.reqs[nxt].arrival_ns == self.now:
                    self._arrive(self.reqs[nxt])
                    self._admit()
                    nxt += 1
            self._admit()
            self._dispatch()
        unfinished = sum(1 for q in self.reqs if q.finished_s is None and not q.refused)
        if horizon == math.inf and unfinished:
            raise SimulationError(f"{unfinished} requests never finished (policy stalled)")
        return SimResult(
            records=tuple(self._record(q) for q in self.reqs),
            makespan_s=self.now / NS_PER_S, frames=dict(sorted(self.frames.items())),
            busy_s=self.busy_ns / NS_PER_S,
            padding={"rows": 1 - self.rows[0] / self.rows[1] if self.rows[1] else 0.0,
                     "prompt_tokens": 1 - self.prompt[0] / self.prompt[1]
                     if self.prompt[1] else 0.0},
            plan_calls=self.plan_calls, speculation=dict(self.speculation),
            wall_s=time.perf_counter() - started,
            cpu_s=time.process_time() - cpu_started,
            unfinished=unfinished,
            vision=self.vision.stats(self.frames) if self.o.vision.images_per_request else {},
            slots=_slot_occupancy(self.reqs, self.now / NS_PER_S),
        )

    # ---- events ----------------------------------------------------------------------

    def _arrive(self, q: _Req) -> None:
        if self.o.max_queue is not None and len(self.waiting) >= self.o.max_queue:
            q.refused = True
            return
        self.waiting.append(q, arrival_ns=q.arrival_ns, prompt_tokens=q.plan.prompt_tokens)

    def _admit(self) -> None:
        while self.waiting and self.resident < self.o.max_resident:
            q = self.waiting.pop()
            target = q.plan.output_tokens
            limit = target if self.o.output_limit <= 0 else max(target, self.o.output_limit)
            images = self.o.vision.plan_for(q.plan.prompt_tokens, self.costs.mean_ns)
            h = self.p.admit(prompt_len=q.plan.prompt_tokens, max_output_tokens=limit,
                             images=images, arrived_ns=q.arrival_ns)
            if images is not None:
                self.vision.plans[h] = images
            self.p.assign_client(h, q.plan.client)
            q.handle = h
            q.admitted_s = self.now / NS_PER_S
            self.by_handle[h] = q
            self.resident += 1

    def _dispatch(self) -> None:
        while len(self.flights) < 2:
            if self.flights and _drains(self.flights[-1].plan):
                return  # nothing may queue behind it (QUEUE-11, QUEUE-12): skip plan()
            self.plan_calls += 1
            plan = self.p.plan()
            if plan is None or not self.p.window_ready(plan):
                return
            shape = plan.shape
            if shape.kind is GraphKind.SPECULATIVE and shape.proposal_depth > 0 \
                    and shape.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT:
                raise SimulationError(f"{shape.label()}: device-allocated rounds are not "
                                      "simulated (they complete through "
                                      "their confidence sidecar)")
            self.fence += 1
            fence = Fence(self.fence)
            self.p.commit(plan, fence)
            duration = self.vision.frame_ns(plan)  # a vision frame's cost is synthetic
            if shape.kind is not GraphKind.VISION:
                duration += self.costs.duration_ns(shape, self.rng, self.o.noise)
            start = self.now + self.o.dispatch_ns
            if self.flights:
                start = max(start, self.flights[-1].end_ns)
            self.flights.append(_Flight(fence, plan, self.now, start, start + duration))
            self._count(plan, duration)

    def _count(self, plan: ScheduledPlan, duration: int) -> None:
        kind = plan.shape.kind.value
        self.frames[kind] = self.frames.get(kind, 0) + 1
        if plan.shape.kind is GraphKind.SPECULATIVE:
            self.speculation["rounds"] += 1
            self.speculation["lanes"] += len(plan.lanes)
        self.busy_ns += duration
        self.rows[0] += len(plan.lanes)
        self.rows[1] += plan.shape.batch_capacity
        capacity = plan.shape.prefill_capacity or (
            plan.shape.token_capacity if plan.shape.kind in PREFILL_KINDS else 0)
        if capacity:
            self.prompt[0] += sum(lane.prompt_tokens for lane in plan.lanes)
            self.prompt[1] += capacity

    def _complete(self) -> None:
        f = self.flights.popleft()
        by_handle = self.by_handle
        records = []
        terminal = False
        counterfactual = self.counterfactuals
        rounds: dict[RequestHandle, tuple[int, int]] = {}
        """Lanes of a round: (output position it started at, drafts)."""
        width_one: list[tuple[RequestHandle, int]] = []
        """Lanes of a width-one step (a decode, a ``W = 1`` round): their positions."""
        for lane in f.plan.lanes:
            q = by_handle[lane.handle]
            if lane.role is LaneRole.TERMINAL or lane.token_ceiling == 0:
                terminal = terminal or lane.role is LaneRole.TERMINAL
                records.append(CompletionRecord(handle=lane.handle, epoch=lane.epoch,
                                                prompt_tokens=lane.prompt_tokens))
                continue
            if counterfactual and lane.role is LaneRole.DECODE:
                if lane.token_ceiling > 1:
                    rounds[lane.handle] = (q.produced, lane.token_ceiling - 1)
                else:
                    width_one.append((lane.handle, q.produced))
            records.append(self._lane_record(q, lane.handle, lane.epoch,
                                             lane.prompt_tokens, lane.token_ceiling))
        timing = ExecutionTiming(device_intervals_ns=(f.end_ns - f.start_ns,),
                                 wall_ns=f.end_ns - f.commit_ns)
        now, now_s = self.now, self.now / NS_PER_S
        published = self.p.published_output
        if counterfactual and rounds:
            tokens = self.p.complete(f.fence, records, timing,
                                     round=RoundCompletion(lanes=self._outcomes(rounds)))
        else:
            tokens = self.p.complete(f.fence, records, timing)
        if counterfactual and not rounds:  # a round's own lanes report none
            for h, position in width_one:
                self.p.observe_counterfactual(
                    h, offered=1, accepted=int(self._run(by_handle[h], position) >= 1),
                    terminated=False)
        for token in tokens:
            q = by_handle[token.handle]
            if token.token_ids:
                q.chunk_times_s.append(now_s)
                q.chunk_tokens.append(float(len(token.token_ids)))
                published(token.handle, f.fence, now)
            if token.finish is not None:
                q.finished_s = now_s
                q.finish = token.finish
                self.finishing += 1
        # Only a finished request or a completed terminal snapshot can free a request
        # (the simulator never cancels), so skip the policy's scan otherwise.
        if self.finishing or terminal:
            for h in self.p.take_released():
                released = by_handle.pop(h, None)
                if released is not None:
                    released.released_s = now_s
                self.vision.release(h)
                self.resident -= 1
                self.finishing = max(self.finishing - 1, 0)

    def _lane_record(self, q: _Req, handle: RequestHandle, epoch: int, prompt_tokens: int,
                     ceiling: int) -> CompletionRecord:
        """A well-formed record for a lane that emits output (see the module doc)."""
        emitted = 1
        if ceiling > 1:  # a speculative lane: ceiling - 1 drafts verified
            accepted = self._accepted(q, ceiling - 1)
            self.speculation["drafted"] += ceiling - 1
            self.speculation["accepted"] += accepted
            emitted = accepted + 1
            if self.o.output_limit > 0:  # the simulated EOS ends the burst
                emitted = max(1, min(emitted, q.plan.output_tokens - q.produced))
        q.produced += emitted
        eos = self.o.output_limit > 0 and q.produced == q.plan.output_tokens
        if emitted == 1 and not prompt_tokens and not eos:
            # The common case, one plain token: records are frozen, so reuse one.
            plain = q.plain_record
            if plain is None or plain.epoch != epoch:
                plain = q.plain_record = CompletionRecord(handle=handle, epoch=epoch,
                                                          token_ids=_TOKENS[1])
            return plain
        return CompletionRecord(handle=handle, epoch=epoch, token_ids=_TOKENS[emitted],
                                prompt_tokens=prompt_tokens, terminated=eos)

    def _accepted(self, q: _Req, drafts: int) -> int:
        """The accepted prefix of ``drafts`` drafts from output position ``q.produced``."""
        return min(self._run(q, q.produced, drafts), drafts)

    def _run(self, q: _Req, position: int, ahead: int = 1) -> int:
        """How many consecutive drafts from output ``position`` on would be accepted
        (draws for at least ``ahead`` more positions are made)."""
        runs = q.accept_runs
        if runs is None or position + ahead >= len(runs):
            runs = q.accept_runs = acceptance_runs(
                self.o.seed, q.plan.index, q.plan.acceptance,
                max(q.plan.output_tokens, position) + ahead + 16)
        return int(runs[position])

    def _outcomes(self, rounds: dict[RequestHandle, tuple[int, int]]
                  ) -> tuple[RoundLaneOutcome, ...]:
        """Each round lane verified all its drafts and reports whether one more would
        have held: when the run from its start reaches it (the policy folds it in as
        one more offered depth, ``learning.round_observations``)."""
        out = []
        for h, (position, drafts) in rounds.items():
            run = self._run(self.by_handle[h], position, drafts + 1)
            out.append(RoundLaneOutcome(handle=h, proposed=drafts, evaluated=drafts,
                                        accepted=min(run, drafts),
                                        beyond=1.0 if run >= drafts + 1 else 0.0))
        return tuple(out)

    def _record(self, q: _Req) -> RequestRecord:
        arrival = q.arrival_ns / NS_PER_S
        if q.refused:
            status, reason = "error", "queue_full"
        elif q.finish is FinishKind.ERROR:
            status, reason = "error", "error"
        elif q.finished_s is None:
            status, reason = "cancelled", None
        else:
            status, reason = "ok", q.finish.value if q.finish else None
        return RequestRecord(
            index=q.plan.index, client=q.plan.client, scheduled_s=arrival, sent_s=arrival,
            status=status,  # type: ignore[arg-type]
            target_prompt_tokens=q.plan.prompt_tokens,
            target_output_tokens=q.plan.output_tokens, prompt_tokens=q.plan.prompt_tokens,
            chunk_times_s=tuple(q.chunk_times_s), chunk_tokens=tuple(q.chunk_tokens),
            finished_s=q.finished_s, finish_reason=reason,
        )


def acceptance_runs(seed: int, index: int, acceptance: float | None, positions: int
                    ) -> np.ndarray:
    """For request ``index``: ``runs[j]`` = how many consecutive output positions from
    ``j`` on have their draft accepted (``u_j < acceptance``, ``u`` from a generator
    seeded with ``(seed, index)``); ``positions`` long. The draws for the first
    positions never depend on ``positions`` (only a run reaching the end is cut)."""
    a = DEFAULT_ACCEPTANCE if acceptance is None else acceptance
    u = np.random.default_rng([seed, index, ACCEPTANCE_DRAWS]).random(positions)
    at = np.arange(positions, dtype=np.int64)
    rejected_at = np.where(u < a, positions, at)
    next_rejection = np.minimum.accumulate(rejected_at[::-1])[::-1]
    runs: np.ndarray = next_rejection - at
    return runs
