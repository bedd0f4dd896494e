"""A lagging learned-draft context (``gpu.draft_state``, ``draft_catch_up = K``).

Ordinary decodes of a learned speculative load leave the draft alone (only the token
history records them); the next learned round re-feeds the draft the positions it
missed, at most K, before proposing. The evidence: with a lag of at most K a round's
drafts and confidences equal those of the maintained path (and transformers' draft
over the whole context), under host-chosen and static windows; decodes and width-one
rounds write no draft KV; greedy output stays the target's with any lag, including
lags past the window, which are given up. SPEC-5 (as flare extends it), SPEC-1,
SPEC-2, MIX-6.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import (
    DECODE,
    PREFILL_64,
    RESTORE,
    SNAPSHOT,
    build_draft_pair,
    prompt_of,
)
from speculative_driver import SpeculativeDriver

from gpu.draft_state import DraftState
from gpu.engine import ModelEngine
from gpu.frames import GREEDY, DecodeFrame, SamplingParams, StepResult
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions
from gpu.programs.speculative_attach import attach_speculation
from gpu.programs.speculative_binding import LEARNED
from policy.descriptors import GraphKind, GraphShape, TargetBinding

QL = TargetBinding.QUERY_LENGTH
PAGE_SIZE = 16
BASE = (PREFILL_64, DECODE[1], DECODE[2], SNAPSHOT, RESTORE)
MIXED_SPEC = GraphShape(kind=GraphKind.MIXED, batch_capacity=2, token_capacity=1,
                        prefill_capacity=64, packed_capacity=65, speculation_enabled=True)


def spec(b: int, w: int) -> GraphShape:
    return GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                      proposal_depth=w - 1, packed_capacity=b * w, binding=QL)


WIDE, NARROW, ONE = spec(2, 4), spec(2, 2), spec(2, 1)
SHAPES = (ONE, NARROW, WIDE, MIXED_SPEC)
PROMPTS = (prompt_of(20, 1), prompt_of(13, 2))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target and a smaller random draft with the same vocabulary."""
    return build_draft_pair(tmp_path_factory.mktemp("catch_up_pair"))


def driver_for(pair: tuple[Path, Path], catch_up: int, *, static: bool = False,
               draft: Path | None = None) -> tuple[SpeculativeDriver, DraftState]:
    engine = ModelEngine.load(
        pair[0], device="cpu", dtype=None, catalog=BASE, page_size=PAGE_SIZE, num_pages=64,
        state_rows=6, require_tokenizer=False,
        execution=ExecutionOptions.static() if static else None)
    draft_state = attach_speculation(engine, SHAPES, source=LEARNED,
                                     draft_model_dir=draft or pair[1], draft_catch_up=catch_up)
    return SpeculativeDriver(engine), draft_state


def draft_pool(draft_state: DraftState) -> torch.Tensor:
    draft = draft_state.draft
    assert draft is not None
    return torch.stack((draft.cache.keys.clone(), draft.cache.values.clone()))


def draft_position(driver: SpeculativeDriver, row: int) -> int:
    return int(driver.engine.parts.state.draft_position[row])


def width_one_steps(driver: SpeculativeDriver, kind: str, steps: int,
                    sampling: SamplingParams) -> list[int]:
    """Prefill row 0, then ``steps`` width-one steps of ``kind``; the tokens so far."""
    generated = [driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64, sampling=sampling)]
    for step in range(steps):
        if kind == "decode":
            generated += driver.decode(DECODE[1], [0])
        elif kind == "speculative":
            generated += driver.speculate(ONE, [0], [1]).lanes[0].tokens
        else:  # a prompt chunk of another request rides along (row 1 at lane 1)
            chunk = PROMPTS[1][step * 2:step * 2 + 2]
            result = driver.mixed(MIXED_SPEC, [0, 1], prefill_row=1, prompt=chunk,
                                  prompt_start=step * 2, prompt_ends=False)
            generated += [result.samples[0].token]
    return generated


@pytest.mark.parametrize("static", [False, True], ids=["host-window", "static-window"])
@pytest.mark.parametrize("kind", ["decode", "speculative", "mixed"])
def test_a_round_after_a_lag_within_the_window_drafts_as_the_maintained_path(
    pair: tuple[Path, Path], kind: str, static: bool
) -> None:
    """SPEC-5 (lagging extension): after five width-one steps (lag 5 <= K = 8) a wide
    round drafts the same tokens with the same confidences as a draft maintained on
    every step, and both equal transformers' draft over the whole context."""
    sampling = SamplingParams(temperature=1.0, seed=77)
    rounds = {}
    for catch_up in (0, 8):
        driver, _ = driver_for(pair, catch_up, static=static)
        generated = width_one_steps(driver, kind, 5, sampling)
        wide = driver.speculate(WIDE, [0], [4])
        rounds[catch_up] = (generated, wide)
    (generated, maintained), (lagged_generated, lagged) = rounds[0], rounds[8]
    assert lagged_generated == generated
    assert lagged.lanes[0].drafts == maintained.lanes[0].drafts
    assert lagged.lanes[0].tokens == maintained.lanes[0].tokens
    np.testing.assert_allclose(lagged.confidence, maintained.confidence, rtol=1e-5, atol=1e-6)

    import transformers as tf

    hf_draft = tf.LlamaForCausalLM.from_pretrained(pair[1]).eval()
    lane = lagged.lanes[0]
    with torch.no_grad():
        ids = torch.tensor([[*PROMPTS[0], *generated, *lane.drafts]])
        probs = torch.softmax(hf_draft(ids).logits[0].double(), dim=-1)
    first = len(PROMPTS[0]) + len(generated) - 1  # the pending token's row
    expected = probs[first:first + 3].max(dim=-1).values.numpy()
    np.testing.assert_allclose(lagged.confidence[0, 0], expected, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("kind", ["decode", "speculative"])
def test_width_one_steps_of_a_lagging_load_write_no_draft_kv(
    pair: tuple[Path, Path], kind: str
) -> None:
    """The point of the lag: ordinary decodes and width-one rounds run no draft forward
    (the draft pool is bit-for-bit unchanged) and leave ``draft_position`` at the prompt's
    end while the position advances; the next wide round catches up to the new position."""
    driver, draft_state = driver_for(pair, 8)
    driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64)
    assert draft_position(driver, 0) == len(PROMPTS[0]) == driver.rows[0].position
    pool = draft_pool(draft_state)
    for _ in range(4):
        if kind == "decode":
            driver.decode(DECODE[1], [0])
        else:
            driver.speculate(ONE, [0], [1])
    assert torch.equal(draft_pool(draft_state), pool)
    assert driver.rows[0].position == len(PROMPTS[0]) + 4
    assert draft_position(driver, 0) == len(PROMPTS[0])
    driver.speculate(WIDE, [0], [4])
    assert draft_position(driver, 0) == driver.rows[0].position


def test_a_maintained_load_still_feeds_the_draft_on_every_decode(
    pair: tuple[Path, Path]
) -> None:
    """``draft_catch_up = 0`` is the seed's rule: a decode writes draft KV."""
    driver, draft_state = driver_for(pair, 0)
    driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64)
    pool = draft_pool(draft_state)
    driver.decode(DECODE[1], [0])
    assert not torch.equal(draft_pool(draft_state), pool)


@pytest.fixture(scope="module")
def plain_greedy(pair: tuple[Path, Path]) -> list[list[int]]:
    driver = ReferenceDriver(ModelEngine.load(
        pair[0], device="cpu", dtype=None, catalog=BASE, page_size=PAGE_SIZE, num_pages=64,
        state_rows=6, require_tokenizer=False))
    out = []
    for row, prompt in enumerate(PROMPTS):
        tokens = [driver.prefill(PREFILL_64, row, prompt, chunk=64)]
        while len(tokens) < 40:
            tokens += driver.decode(DECODE[2], [row])
        out.append(tokens)
    return out


@pytest.mark.parametrize("catch_up", [2, 8])
@pytest.mark.parametrize("draft", ["tiny", "target"])
def test_greedy_output_is_the_targets_with_any_lag(
    pair: tuple[Path, Path], plain_greedy: list[list[int]], catch_up: int, draft: str
) -> None:
    """Runs of 1..6 decodes between rounds, lags both within and past the window
    (K = 2 gives some up): greedy output equals plain greedy decoding token for token,
    and every round leaves ``draft_position`` at the new position. With the target as
    its own draft, every round accepts every draft until a lag passes the window."""
    driver, _ = driver_for(pair, catch_up, draft=pair[0] if draft == "target" else None)
    outputs = [[driver.prefill(PREFILL_64, row, p, chunk=64)] for row, p in enumerate(PROMPTS)]
    decodes, full_rounds, clean_rounds, given_up = 1, 0, 0, False
    while any(len(o) < 40 for o in outputs):
        for _ in range(decodes):
            for row, token in enumerate(driver.decode(DECODE[2], [0, 1])):
                outputs[row].append(token)
        lag = max(driver.rows[r].position - draft_position(driver, r) for r in (0, 1))
        given_up |= lag > catch_up  # positions older than the window stay stale
        result = driver.speculate(WIDE, [0, 1], [4, 4])
        for lane in result.lanes:
            outputs[lane.row].extend(lane.tokens)
            assert draft_position(driver, lane.row) == driver.rows[lane.row].position
        if not given_up:
            clean_rounds += 1
            full_rounds += all(lane.accepted == 3 for lane in result.lanes)
        decodes = decodes % 6 + 1
    assert [o[:40] for o in outputs] == plain_greedy
    if draft == "target":
        assert full_rounds == clean_rounds > 0


def test_prompt_chunks_continue_the_draft_context_and_restore_copies_it(
    pair: tuple[Path, Path]
) -> None:
    """Prefill chunks and the prompt lane of mixed frames advance ``draft_position``
    (they feed the draft, chunk after chunk); a snapshot and restore carry it with the
    row, so a restored row needs no more catch-up than its source."""
    driver, _ = driver_for(pair, 8)
    driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=8)  # chunks of 8, 8 and 4
    assert draft_position(driver, 0) == len(PROMPTS[0])
    for step in range(3):  # row 1's prompt rides along row 0's decodes, two at a time
        driver.mixed(MIXED_SPEC, [0, 1], prefill_row=1, prompt=PROMPTS[1][step * 2:step * 2 + 2],
                     prompt_start=step * 2, prompt_ends=False)
    assert draft_position(driver, 1) == 6
    # row 0's decode rows in those mixed frames fed the draft too, with no gap
    assert draft_position(driver, 0) == driver.rows[0].position == len(PROMPTS[0]) + 3
    driver.decode(DECODE[1], [0])  # a lagging decode: row 0 now lags one position
    driver.copy_row(SNAPSHOT, 0, 3)
    driver.copy_row(RESTORE, 3, 4)
    assert draft_position(driver, 4) == draft_position(driver, 0) == len(PROMPTS[0]) + 3
    assert driver.rows[4].position == driver.rows[0].position


def test_the_first_round_captures_every_catch_up_window(pair: tuple[Path, Path]) -> None:
    """CPU forward capture: the first learned round traces the draft's first step at
    every window ``bind`` may choose (with every context bucket), so rounds after any
    lag trace nothing mid-load; a tracing stall is the stream standing still."""
    engine = ModelEngine.load(
        pair[0], device="cpu", dtype=None, catalog=BASE, page_size=PAGE_SIZE, num_pages=64,
        state_rows=6, require_tokenizer=False,
        execution=ExecutionOptions.eager(capture_forward=True))
    draft_state = attach_speculation(engine, SHAPES, source=LEARNED, draft_model_dir=pair[1],
                                     draft_catch_up=8)
    driver = SpeculativeDriver(engine)
    assert draft_state.draft is not None
    capture = draft_state.draft.decoder.capture
    assert capture is not None
    driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64)
    driver.speculate(WIDE, [0], [4])
    traced = len(capture)
    lags = []
    for decodes in (1, 2, 3, 5, 8, 12):
        for _ in range(decodes):
            driver.decode(DECODE[1], [0])
        lags.append(driver.rows[0].position - draft_position(driver, 0))
        driver.speculate(WIDE, [0], [4])
    assert lags == [1, 2, 3, 5, 8, 12]
    assert len(capture) == traced


@pytest.mark.parametrize("kind", ["decode", "speculative"])
def test_maintained_width_one_steps_report_the_drafts_first_proposal(
    pair: tuple[Path, Path], kind: str
) -> None:
    """A maintained width-one step feeds the draft the pending token, so it reports the
    draft's greedy proposal for the token it emits: the first draft a wide round from
    the same context would have verified (a depth-one counterfactual round). A lagging
    load runs no draft there and reports none (-1)."""
    reported = {}
    for catch_up in (0, 8):
        driver, _ = driver_for(pair, catch_up)
        driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64)
        if kind == "decode":
            step = driver.run(DECODE[1], DecodeFrame(rows=(0,), updates=driver.pages_for(0, 21)))
            assert isinstance(step, StepResult)
            driver.rows[0].position += 1
            reported[catch_up] = step.samples[0].draft_proposal
        else:
            reported[catch_up] = driver.speculate(ONE, [0], [1]).lanes[0].draft_proposal
    reference, _ = driver_for(pair, 0)
    reference.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64)
    first_draft = reference.speculate(WIDE, [0], [4]).lanes[0].drafts[0]
    assert reported == {0: first_draft, 8: -1}


def _width_one_acceptance(driver: SpeculativeDriver, kind: str,
                          sampling: SamplingParams) -> float:
    """Prefill row 0 with ``sampling``, run one maintained width-one step of ``kind``
    and return the ``draft_acceptance`` it reports for the lane."""
    driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64, sampling=sampling)
    if kind == "decode":
        step = driver.run(DECODE[1], DecodeFrame(rows=(0,), updates=driver.pages_for(0, 21)))
        assert isinstance(step, StepResult)
        return step.samples[0].draft_acceptance
    return driver.speculate(ONE, [0], [1]).lanes[0].draft_acceptance


def test_sampled_width_one_steps_report_the_depth_one_acceptance_probability(
        pair: tuple[Path, Path]) -> None:
    """A maintained width-one step with a sampled lane reports ``sum min(p, q)`` of the
    target's and the draft's filtered distributions for its token: a decode
    (``DraftMaintainingProgram``) and a ``W = 1`` round (``SpeculativeProgram``) from the
    same context compute it independently and agree; the small random draft gives a
    value strictly inside (0, 1), the target as its own draft exactly what identical
    distributions give (1); greedy lanes report none (-1, their proposal decides)."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=0, seed=3)
    small = {kind: _width_one_acceptance(driver_for(pair, 0)[0], kind, sampling)
             for kind in ("decode", "round")}
    assert 0.0 < small["decode"] < 1.0
    assert small["decode"] == pytest.approx(small["round"], abs=1e-5)
    for kind in ("decode", "round"):
        perfect = _width_one_acceptance(driver_for(pair, 0, draft=pair[0])[0], kind, sampling)
        assert perfect == pytest.approx(1.0, abs=1e-5)
        greedy = _width_one_acceptance(driver_for(pair, 0)[0], kind, GREEDY)
        assert greedy == -1.0


def _round_beyond(pair: tuple[Path, Path], shape: GraphShape, *, draft: Path | None = None,
                  sampling: SamplingParams | None = None,
                  ceiling: int | None = None) -> tuple[float, int, int]:
    """Prefill row 0, run one learned round of ``shape`` (full width unless ``ceiling``):
    (beyond, accepted, the drafts the target verified)."""
    driver, _ = driver_for(pair, 0, draft=draft)
    driver.prefill(PREFILL_64, 0, PROMPTS[0], chunk=64, sampling=sampling or GREEDY)
    lane = driver.speculate(shape, [0], [ceiling or shape.token_capacity]).lanes[0]
    return lane.beyond, lane.accepted, lane.evaluated


def test_a_learned_round_reports_whether_one_more_draft_would_hold(
        pair: tuple[Path, Path]) -> None:
    """A learned round of depth ``D`` runs the draft once more to cache its last draft's
    KV; that step's proposal is the ``(D + 1)``-th draft a wider round from the same
    context would draft. A lane that verified all ``D`` drafts reports whether it would
    have held at the target's row ``D`` (``SpeculativeLane.beyond``): the target as its
    own draft always holds (greedy 1; sampled ``sum min(p, p)`` = 1). The small random
    draft's lane reports a value too, whatever it accepted (the planner multiplies it by
    the prefix's survival, so observing depth ``D + 1`` never depends on the outcome);
    where it accepted, its ``D = 1`` verdict must agree with a ``D = 3`` round from the
    same context. A lane whose ceiling cut its drafts verified no row ``D``: -1."""
    for shape in (NARROW, WIDE):
        assert _round_beyond(pair, shape, draft=pair[0]) == (1.0, shape.proposal_depth,
                                                             shape.proposal_depth)
        sampled, accepted, depth = _round_beyond(
            pair, shape, draft=pair[0],
            sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=4))
        assert accepted == depth and sampled == pytest.approx(1.0, abs=1e-5)
    beyond, accepted, depth = _round_beyond(pair, NARROW)
    assert beyond in (0.0, 1.0)
    if accepted == depth:
        wide = _round_beyond(pair, WIDE)
        assert beyond == float(wide[1] >= 2)
    sampled, _, _ = _round_beyond(pair, WIDE,
                                  sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=4))
    assert 0.0 <= sampled <= 1.0
    cut, _, verified = _round_beyond(pair, WIDE, draft=pair[0], ceiling=2)
    assert (cut, verified) == (-1.0, 1)
