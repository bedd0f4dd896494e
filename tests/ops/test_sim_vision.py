"""``flare sim`` with image prompts (``ops.sim.vision``): requests are admitted with
their image plan, chunks follow the window and atomic-span rules, and a prompt frame's
duration includes encoding its active window's new images.

One 120-token prompt holding three 20-token images at 0, 40 and 80, a 64-token prefill
program (10 ms) and 4 ms per encoded image. One-image windows: chunks end at 40, 80,
120 and each encodes its window's image (14 ms frames). One window of all three: a
chunk from 0 may run to 80 (the image at 80..100 would not fit a 64-token chunk from
0), so it runs 64 tokens, ending between images, and encodes all three images
(22 ms); the second runs the rest (10 ms).
"""

from __future__ import annotations

import pytest

from ops.loadgen.workload import RequestPlan
from ops.sim.costs import CostTable
from ops.sim.engine import SimOptions, simulate
from ops.sim.vision import VisionLoad
from policy.baselines import make_policy
from policy.descriptors import GraphKind, GraphShape

MS = 1_000_000
PREFILL_64 = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=64)
DECODE_1 = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1,
                      packed_capacity=1)
COSTS = CostTable({PREFILL_64: 10 * MS, DECODE_1: 5 * MS}, source="test")
REQUEST = RequestPlan(index=0, client="c", arrival_s=1.0, prompt_tokens=120, output_tokens=2)


def _run(policy: str, window_images: int):  # type: ignore[no-untyped-def]
    load = VisionLoad(images_per_request=3, tokens_per_image=20,
                      window_images=window_images, ms_per_image=4.0)
    planner = make_policy(policy, catalog=(PREFILL_64, DECODE_1))
    return simulate(planner, [REQUEST], COSTS,
                    SimOptions(dispatch_ns=1 * MS, output_limit=0, vision=load))


def test_image_plan_spreads_images_that_fit() -> None:
    load = VisionLoad(images_per_request=3, tokens_per_image=20)
    plan = load.plan_for(120, (PREFILL_64,))
    assert plan is not None and plan.spans == ((0, 20), (40, 60), (80, 100))
    assert plan.atomic_capacity == 64
    assert load.plan_for(45, (PREFILL_64,)).spans == ((0, 20), (22, 42))  # type: ignore[union-attr]
    assert load.plan_for(10, (PREFILL_64,)) is None


@pytest.mark.parametrize("policy", ["balanced", "fcfs"])
def test_windows_shape_the_chunks_and_vision_time_enters_frames(policy: str) -> None:
    """Covers PRE-27, PRE-28, PRE-29 in the simulator: one-image windows give three
    14 ms prompt frames (first token at 1.045); one window gives a 22 ms frame that
    encodes every image and a 10 ms one (first token at 1.034). Every image is
    encoded once either way."""
    windowed, whole = _run(policy, 1), _run(policy, 8)
    assert windowed.frames["prefill"] == 3 and whole.frames["prefill"] == 2
    assert windowed.vision["images_encoded"] == whole.vision["images_encoded"] == 3
    assert windowed.vision["busy_s"] == whole.vision["busy_s"] == pytest.approx(0.012)
    assert windowed.records[0].ttft_s == pytest.approx(0.045)
    assert whole.records[0].ttft_s == pytest.approx(0.034)
    assert whole.stats_json()["vision"]["images_encoded"] == 3


def test_no_images_no_vision_stats() -> None:
    planner = make_policy("balanced", catalog=(PREFILL_64, DECODE_1))
    result = simulate(planner, [REQUEST], COSTS, SimOptions(dispatch_ns=1 * MS))
    assert result.vision == {} and "vision" not in result.stats_json()


def _scheduled(scheduled: bool):  # type: ignore[no-untyped-def]
    load = VisionLoad(images_per_request=3, tokens_per_image=20, window_images=8,
                      ms_per_image=4.0, ms_per_execution=2.0, scheduled=scheduled)
    planner = make_policy("balanced", catalog=load.catalog((PREFILL_64, DECODE_1)))
    return simulate(planner, [REQUEST], COSTS,
                    SimOptions(dispatch_ns=1 * MS, output_limit=0, vision=load))


def test_scheduled_vision_runs_its_own_frame() -> None:
    """Covers PRE-1, PRE-24, PRE-27 in the simulator: with vision programs in the
    catalog (1, 2, 4 and 8 images, unmeasured), the window's three images are encoded by
    one discovered vision frame, the four-image program (2 + 16 ms; the smallest that
    holds them), before the two 10 ms prompt frames (first token at 1.041). Fused, the
    first prompt frame encodes them one per execution (3 x 6 ms; first token at
    1.040)."""
    scheduled, fused = _scheduled(True), _scheduled(False)
    assert scheduled.frames["vision"] == 1 and scheduled.frames["prefill"] == 2
    assert scheduled.vision["images_encoded"] == fused.vision["images_encoded"] == 3
    assert scheduled.vision["busy_s"] == pytest.approx(0.018)
    assert fused.vision["busy_s"] == pytest.approx(0.018)
    assert scheduled.records[0].ttft_s == pytest.approx(0.041)
    assert fused.records[0].ttft_s == pytest.approx(0.040)
    assert "vision" not in fused.frames
