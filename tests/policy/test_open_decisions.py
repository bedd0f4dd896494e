"""Pins flare's decisions on open points of docs/design/requirements.md that no other test
cited: OPEN-4 (what alpha affects), OPEN-14 (the scaling factor), OPEN-25 (which families
declare mixed capture), OPEN-28 (request limits and forecast observations) and OPEN-38
(distinct names for durations and program extents). Each test fails when the decision
changes."""

from __future__ import annotations

import dataclasses
import inspect
import math

import numpy as np
import pytest
from selection_setup import make_decoder, reference_rate
from synthetic_catalog import decode, measured_scheduler
from test_learning import ADAPTIVE, DEVICE, MS, spec

from gpu.catalog import (
    CatalogFlags,
    balanced_prompt_bucket,
    build_catalog,
    mixed_shapes,
    prompt_bucket_ladder,
)
from gpu.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, parse_model_config
from policy.config import PolicyConfig
from policy.credit_ledgers import (
    CreditLedger,
    acceptance_learning_ledger,
    timing_refresh_ledger,
)
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape
from policy.learning import find_probe, ordinary_from_round
from policy.protocol import RoundCompletion, RoundLaneOutcome
from policy.round_speculation import SpeculationSettings
from policy.round_table import (
    RoundCandidate,
    SpeculativeLane,
    forecast_observation,
    lane_ceiling,
    observe_completed_round,
    speculative_lane,
)
from policy.rounds import best_round, frontier_allocation, round_candidates
from policy.scheduler import Scheduler
from policy.service import delivery_price, output_token_price
from policy.speculation import INITIAL_WEIGHT, AcceptanceState, ProposalSource, expected_output
from policy.types import CompletionRecord, Fence, Phase, RequestHandle, ScheduledPlan


def lane(h: int, *, token: float, survival: tuple[float, ...],
         optimistic: tuple[float, ...] = (), forecast: tuple[float, ...] = (),
         weights: tuple[float, ...] = (), limit: int = 100) -> SpeculativeLane:
    return SpeculativeLane(handle=RequestHandle(h), epoch=1, token_value=token,
                           delivery_value=0.5, age_value=0.0, age_slope=0.0,
                           output_limit=limit, context_limit=10**6, survival=survival,
                           forecast=forecast, optimistic=optimistic, weights=weights)


def best(lanes: list[SpeculativeLane], shapes: list[GraphShape],
         est: dict[GraphShape, int], alpha: float) -> RoundCandidate:
    got = best_round(round_candidates(lanes, shapes, est, alpha=alpha, waiting=0.0,
                                      mode=ADAPTIVE, keep_dominated=True))
    assert got is not None
    return got


# ---------------------------------------------------------------------------- OPEN-4


def test_open_4_alpha_shapes_host_lengths_but_not_the_device_frontier() -> None:
    """Covers OPEN-4: ``adaptive_verification_alpha`` enters every lane value flare
    computes from survival, so it changes the host-allocated lengths of an adaptive
    ``QueryLength`` program (chosen to maximise the alpha-scored value), while the
    acceptance estimates themselves and the rows a device-allocated program is priced
    with (the frontier rule on forecasts) do not depend on it."""
    # P = 5 binds two lanes of ceiling 4: three extra rows go to one lane or the other.
    # Increments are token * s**alpha: lane 2 wins at alpha 1 (2*0.5 > 0.8), lane 1 at
    # alpha 3 (0.512 > 2*0.125).
    host = spec(2, 3, 4, 5)
    lanes = [lane(1, token=1.0, survival=(0.8, 0.8, 0.8)),
             lane(2, token=2.0, survival=(0.5, 0.5, 0.5))]
    rows = {a: {int(ln.handle): ln.rows for ln in best(lanes, [host], {host: 10 * MS}, a).lanes}
            for a in (1.0, 3.0)}
    assert rows[1.0] == {1: 1, 2: 4}
    assert rows[3.0] == {1: 4, 2: 1}

    # The same lanes on a device-allocated program: rows follow the forecast frontier
    # whatever alpha is; only the value of those rows changes.
    device = spec(2, 3, 4, 5, DEVICE)
    forecast = ((0.9, 0.6, 0.3), (0.7, 0.65, 0.1))
    dev_lanes = [lane(1, token=1.0, survival=(0.8, 0.8, 0.8), forecast=forecast[0]),
                 lane(2, token=2.0, survival=(0.5, 0.5, 0.5), forecast=forecast[1])]
    frontier = frontier_allocation(np.array(forecast), [4, 4], 5)
    priced = {a: best(dev_lanes, [device], {device: 10 * MS}, a) for a in (1.0, 3.0)}
    for got in priced.values():
        assert sorted((int(ln.handle), ln.rows) for ln in got.lanes) == [
            (1, frontier[0]), (2, frontier[1])]
    assert priced[3.0].rate != priced[1.0].rate

    # Building a lane from acceptance state takes no alpha: the estimates are raw means.
    assert "alpha" not in inspect.signature(speculative_lane).parameters
    assert "alpha" not in inspect.signature(frontier_allocation).parameters


def test_open_4_alpha_enters_probe_scores_and_frozen_probe_service() -> None:
    """Covers OPEN-4: a probe is scored with ``optimistic ** alpha`` and the service its
    plan freezes is the means raised to alpha, the same exponent as ordinary selection."""
    w1, w2, w4 = spec(1, 0, 1), spec(1, 1, 2), spec(1, 3, 4)
    shapes = [w1, w2, w4]
    est = {w1: 10 * MS, w2: 12 * MS, w4: 16 * MS}
    means, weight = (0.5, 0.25, 0.125), 50.0
    optimistic = tuple(min(1.0, m + math.sqrt(math.log(20) / (2 * weight))) for m in means)
    lanes = [lane(1, token=1.0, survival=means, optimistic=optimistic, forecast=means,
                  weights=(weight,) * 3)]
    for alpha in (1.0, 2.0):
        ordinary = best(lanes, shapes, est, alpha)
        ledger = acceptance_learning_ledger()
        ledger.earn(495 * MS)
        got = find_probe(lanes=lanes, shapes=shapes, estimates_ns=est,
                         ordinary=ordinary_from_round(ordinary), ledger=ledger, mode=ADAPTIVE,
                         alpha=alpha, waiting=0.0, refresh_pending=False)
        assert got is not None
        chosen, frozen = got.candidate.lanes[0], got.expected.lanes[0]
        assert frozen.rows == chosen.rows >= 2
        assert chosen.expected_tokens == pytest.approx(
            expected_output(optimistic, width=chosen.rows, alpha=alpha, limit=100))
        assert frozen.expected_tokens == pytest.approx(
            expected_output(means, width=frozen.rows, alpha=alpha, limit=100))
        if alpha != 1.0:  # alpha changed the numbers, not only the ranking
            assert frozen.expected_tokens != pytest.approx(
                expected_output(means, width=frozen.rows, alpha=1.0, limit=100))


# --------------------------------------------------------------------------- OPEN-14


def _decision(scale: float) -> tuple[Scheduler, ScheduledPlan]:
    cfg = PolicyConfig(token_fairness=16.0 * scale, output_token_value=64.0 * scale,
                       delivery_fairness=4.0 * scale, decode_age_price=0.1 * scale,
                       terminal_value=256.0 * scale, terminal_age_price=scale)
    s = measured_scheduler((decode(1), decode(2)), cfg)
    make_decoder(s, token_rate=0.011, delivery_rate=0.3, age_ms=4.0)
    make_decoder(s, token_rate=0.5, delivery_rate=0.02, age_ms=9.0)
    plan = s.plan()
    assert plan is not None
    return s, plan


def test_open_14_scale_is_a_power_of_two_from_the_largest_price() -> None:
    """Covers OPEN-14: the decision's shared factor is ``2**-e``, with ``e`` the binary
    exponent of its largest price or coefficient (which the factor brings into
    [0.5, 1)); scaled = raw * 2**-e, ``selection_log_scale() = e * ln 2``, so
    ``ldexp(selection_value_rate(), e)`` reproduces the raw F-SEL score."""
    s, plan = _decision(1.0)
    cfg = s.config
    prices = [cfg.decode_age_price, cfg.terminal_value, cfg.terminal_age_price]
    for h in plan.handles():
        history = s.request(h).history
        prices += [output_token_price(history, cfg), delivery_price(history, cfg)]
    largest = max(prices)
    assert largest > cfg.terminal_value  # a decoder's price sets the scale here
    e = math.frexp(largest)[1]
    assert 0.5 <= math.ldexp(largest, -e) < 1.0
    assert plan.scale_exponent == e
    assert plan.selection_log_scale() == pytest.approx(e * math.log(2.0), rel=1e-15)
    raw = reference_rate(s, plan.shape, None, 0, plan.handles())
    assert math.ldexp(plan.selection_value_rate(), e) == pytest.approx(raw, rel=1e-12)
    assert plan.selection_value_rate() * math.exp(plan.selection_log_scale()) == \
        pytest.approx(raw, rel=1e-12)
    # A power of two: every price times 2**20 moves e by exactly 20 and leaves the scaled
    # score bit for bit (a factor such as 1/largest would not give an integer exponent).
    _, big = _decision(2.0**20)
    assert big.scale_exponent == e + 20
    assert big.selection_value_rate() == plan.selection_value_rate()
    assert big.selection_log_scale() / math.log(2.0) == pytest.approx(e + 20, abs=1e-9)


# --------------------------------------------------------------------------- OPEN-25


def _raw_config(arch: str, **extra: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "architectures": [arch], "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 10,
    }
    raw.update(extra)
    return raw


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_open_25_every_loaded_family_declares_mixed_capture(arch: str) -> None:
    """Covers OPEN-25: every model family flare loads (Llama, Qwen2, Qwen3) declares mixed
    capture at decode width one, through the ``ModelConfig.mixed_capture`` property in
    ``gpu/model/config.py`` (code, not a ``config.json`` key), so ``--mixed-prefill``
    gives each family width-one mixed programs at every batch bucket from 2."""
    assert isinstance(inspect.getattr_static(ModelConfig, "mixed_capture"), property)
    config = parse_model_config(_raw_config(arch))
    assert config.mixed_capture is True
    # A checkpoint cannot switch it off: the declaration belongs to the family.
    assert parse_model_config(_raw_config(arch, mixed_capture=False)).mixed_capture is True
    ordinary = build_catalog(CatalogFlags(max_batch=4, prefill_capacities=(256,),
                                          mixed_prefill=True,
                                          family_supports_mixed=config.mixed_capture))
    mixed = ordinary.of_kind(GraphKind.MIXED)
    assert {s.batch_capacity for s in mixed} == {2, 4}
    assert all(s.token_capacity == 1 for s in mixed)


# --------------------------------------------------------------------------- OPEN-28


def test_open_28_request_limit_does_not_shorten_the_forecast_observation() -> None:
    """Covers OPEN-28: a completed round's (and so a probe's) forecast observation stops
    at the program's frozen ``min(D + 1, W)`` ceiling only; a request limit below it
    does not truncate it (termination already censors acceptance, ACC-8)."""
    shape = spec(4, 5, 6)
    assert lane_ceiling(shape, 2) == 2  # SPEC-25: the lane's ceiling sees the limit
    row = (0.9, 0.8, 0.7, 0.6, 0.5)
    assert forecast_observation(row, shape) == row  # min(D, W - 1) = 5 positions
    assert list(inspect.signature(forecast_observation).parameters) == ["joint_prefix", "shape"]
    state = AcceptanceState()
    observe_completed_round(state, ProposalSource.LEARNED, shape, joint_prefix=row,
                            offered=1, accepted=0, terminated=False)
    forecast = state.forecast(ProposalSource.LEARNED)
    assert [forecast.weight(d) for d in range(1, 7)] == [INITIAL_WEIGHT + 1] * 5 + [
        INITIAL_WEIGHT]


def test_open_28_scheduler_reads_the_sidecar_past_a_limited_lane_ceiling() -> None:
    """Covers OPEN-28 through the scheduler: in a device round a lane whose request limit
    gives it ceiling 2 still observes every forecast position the program produced."""
    wide = spec(4, 3, 4, binding=DEVICE)
    shapes = [GraphShape(kind=GraphKind.DECODE, batch_capacity=4, token_capacity=1,
                         packed_capacity=4), spec(4, 0, 1, binding=DEVICE),
              spec(4, 1, 2, binding=DEVICE), wide]
    s = Scheduler(catalog=shapes, speculation=SpeculationSettings(mode=ADAPTIVE))
    s.advance_to(1_000 * MS)
    for shape in shapes:
        s.estimates.observe(shape, (10 + shape.token_capacity // 2) * MS, s.now_ns)
    handles = []
    for room in (500, 500, 500, 2):
        h = s.admit(prompt_len=64, max_output_tokens=room + 1)
        rec = s.request(h)
        rec.phase = Phase.DECODE
        rec.prompt_cursor = 64
        rec.output_committed = 1
        rec.last_visible_ns = s.now_ns - 5 * MS
        s.preseed_acceptance(h, (0.95, 0.9, 0.85))
        handles.append(h)
    limited = handles[-1]
    plan = s.plan()
    assert plan is not None and plan.shape == wide
    ceilings = {ln.handle: ln.token_ceiling for ln in plan.lanes}
    assert ceilings[limited] == 2 and ceilings[handles[0]] == 4
    s.commit(plan, Fence(1))
    records = [CompletionRecord(handle=ln.handle, epoch=ln.epoch, token_ids=(7,))
               for ln in plan.lanes]
    sidecar = [[[0.9, 0.8, 0.7]] * 4, [[0.9, 0.72, 0.5]] * 4]
    outcomes = tuple(RoundLaneOutcome(handle=ln.handle, proposed=ln.token_ceiling - 1,
                                      evaluated=ln.token_ceiling - 1, accepted=0)
                     for ln in plan.lanes)
    s.complete(Fence(1), records, ExecutionTiming(device_intervals_ns=(12 * MS,),
                                                  wall_ns=12 * MS),
               round=RoundCompletion(lanes=outcomes, confidence=sidecar))
    forecast = s.acceptance(limited).forecast(ProposalSource.LEARNED)
    aged = 0.5 ** (1 / 128)  # one generated token ages every weight (ACC-23)
    for depth in (1, 2, 3):  # depths 2 and 3 lie past the lane's one draft
        assert forecast.weight(depth) == pytest.approx((INITIAL_WEIGHT + 1) * aged)
    assert forecast.mean(3) == pytest.approx((INITIAL_WEIGHT * 0.125 + 0.5) / (INITIAL_WEIGHT + 1))


# --------------------------------------------------------------------------- OPEN-38


def test_open_38_durations_and_extents_have_distinct_names() -> None:
    """Covers OPEN-38: in the funded bounds (REF-18, LRN-17) O, P and D are the ledger's
    integer-ns durations ``ordinary_ns``, ``episodes_ns`` and
    ``current_or_last_episode_ns``, and in the mixed-bucket rule (MIX-41) P is a mixed
    program's ``prefill_capacity``; none reuses the program-extent names
    ``packed_capacity``, ``proposal_depth`` or ``token_capacity``."""
    extents = {f.name for f in dataclasses.fields(GraphShape)}
    assert {"packed_capacity", "proposal_depth", "token_capacity"} <= extents
    durations = ("ordinary_ns", "episodes_ns", "current_or_last_episode_ns")
    for name in durations:
        assert isinstance(inspect.getattr_static(CreditLedger, name), property)
    assert not extents & set(durations)
    assert list(inspect.signature(CreditLedger.earn).parameters) == ["self", "ordinary_ns"]
    assert list(inspect.signature(CreditLedger.charge).parameters) == ["self", "ns"]
    for ledger in (timing_refresh_ledger(), acceptance_learning_ledger()):
        ledger.earn(2_495 * MS)
        ledger.begin_episode()
        ledger.charge(7 * MS)
        ledger.end_episode()
        ledger.earn(3 * MS)
        assert (ledger.ordinary_ns, ledger.episodes_ns, ledger.current_or_last_episode_ns) \
            == (2_498 * MS, 7 * MS, 7 * MS)
        assert ledger.bound_holds()

    # MIX-41's P is the prompt bucket: the mixed program's prefill_capacity, while its
    # packed extent (SPEC-1's P) is prefill + (B - 1) * W.
    ladder = prompt_bucket_ladder(4096)
    assert "buckets" in inspect.signature(balanced_prompt_bucket).parameters
    assert {"prompt_buckets", "draft_depth"} <= set(inspect.signature(mixed_shapes).parameters)
    wider = [s for s in mixed_shapes(max_batch=4, prompt_buckets=ladder, draft_depth=5,
                                     envelope=6) if s.token_capacity > 1]
    assert wider
    for shape in wider:
        assert shape.prefill_capacity == balanced_prompt_bucket(ladder) == 512
        assert shape.packed_capacity == shape.prefill_capacity + (
            shape.batch_capacity - 1) * shape.token_capacity
        assert shape.proposal_depth == shape.token_capacity - 1
