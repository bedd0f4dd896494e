"""CPU forward capture (``gpu.model.capture``): captured programs give bit-identical
outputs and cache contents to the op-by-op forward, trace once per input shape (one
graph serves every context width), and a launch that traced reports the replay's cost, not the capture's (seed: *Duration
estimates*; the prepared-program contract: fixed shapes, replayed work)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import CATALOG, DECODE, PAGE_SIZE, PREFILL_64, PREFILL_128
from test_programs_execution import _scenario

import gpu.backends.cpu as cpu_backend
from gpu.backends.protocol import LaunchHandle
from gpu.engine import ModelEngine
from gpu.frames import GREEDY, TOP_LOGPROBS, RowInit, SamplingParams
from gpu.model import capture
from gpu.model.batch import PackedBatch
from gpu.programs.driver import ReferenceDriver
from gpu.programs.execution import ExecutionOptions
from gpu.programs.step import STEP_GRAPH_MAX_PROMPT
from policy.descriptors import GraphKind, GraphShape


def _engine(model_dir: Path, *, capture_forward: bool) -> ModelEngine:
    return ModelEngine.load(model_dir, device="cpu", dtype=None, catalog=CATALOG,
                            page_size=PAGE_SIZE, num_pages=96, state_rows=8,
                            execution=ExecutionOptions.eager(capture_forward=capture_forward))


class _Driver(ReferenceDriver):
    """A reference driver whose rows ask for ``top`` alternatives."""

    def __init__(self, engine: ModelEngine, top: int) -> None:
        super().__init__(engine)
        self._top = top

    def init_row(self, row: int, sampling: SamplingParams = GREEDY, **kwargs: Any) -> RowInit:
        return replace(super().init_row(row, sampling, **kwargs), top_logprobs=self._top)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("top", [TOP_LOGPROBS, 0])
def test_captured_forward_is_bit_identical_to_the_op_by_op_forward(
        kind: str, top: int, tiny_checkpoints: dict[str, Path]) -> None:
    """Prefill, decode at four batch sizes and mixed frames (phase split, own prompt
    bound), greedy and seeded sampling: same tokens, logprobs and K/V pools, bit for
    bit; each distinct input shape traced exactly once. Without top alternatives the
    greedy and the sampled frames replay whole traced steps
    (``gpu.programs.step_body``), the others the traced forward."""
    eager = _Driver(_engine(tiny_checkpoints[kind], capture_forward=False), top)
    captured = _Driver(_engine(tiny_checkpoints[kind], capture_forward=True), top)
    assert eager.engine.parts.decoder.capture is None
    graphs = captured.engine.parts.decoder.capture
    assert graphs is not None and len(graphs) == 0

    eager_out, eager_logprobs, eager_blocks = _scenario(eager)
    captured_out, captured_logprobs, captured_blocks = _scenario(captured)

    assert captured_out == eager_out
    assert captured_logprobs == eager_logprobs  # exact: same aten ops, no fusion
    assert captured_blocks == eager_blocks
    # every real page equal (the last page is the sink, scratch for padding, MIX-15)
    for pool in ("keys", "values"):
        assert torch.equal(getattr(captured.engine.parts.cache, pool)[:, :-1],
                           getattr(eager.engine.parts.cache, pool)[:, :-1])
    # per program shape, whatever the context widths (1 to 13 blocks here): one
    # forward graph (the mixed program's with and without a prompt) and two whole-step
    # graphs (``gpu.programs.step_body``: greedy and sampled frames) for prefill, four
    # decodes and the mixed program
    assert sorted(set(captured_blocks)) != [captured_blocks[0]]
    assert graphs.traced <= len(graphs)
    assert graphs.steps <= 12
    assert len(graphs) - graphs.steps <= 7
    bound, shared = len(graphs), capture.shared_graphs()
    _scenario(captured)
    assert (len(graphs), capture.shared_graphs()) == (bound, shared)
    # a second engine of the same model replays the graphs the first one traced
    again = _Driver(_engine(tiny_checkpoints[kind], capture_forward=True), top)
    again_out, again_logprobs, _ = _scenario(again)
    assert (again_out, again_logprobs) == (eager_out, eager_logprobs)
    assert again.engine.parts.decoder.capture is not None
    assert again.engine.parts.decoder.capture.traced == 0
    assert capture.shared_graphs() == shared


def test_only_programs_of_short_prompt_chunks_replay_whole_step_graphs(
        tiny_checkpoints: dict[str, Path]) -> None:
    """A greedy prefill of a program whose chunk exceeds ``STEP_GRAPH_MAX_PROMPT``
    replays its forward graph only; one within it replays a whole-step graph too, and
    both pick the op-by-op programs' first token."""
    assert PREFILL_64.token_capacity <= STEP_GRAPH_MAX_PROMPT < PREFILL_128.token_capacity
    prompt = list(range(5, 45))
    eager = ReferenceDriver(_engine(tiny_checkpoints["llama"], capture_forward=False))
    expected = eager.prefill(PREFILL_128, 0, prompt, chunk=128)
    driver = ReferenceDriver(_engine(tiny_checkpoints["llama"], capture_forward=True))
    graphs = driver.engine.parts.decoder.capture
    assert graphs is not None
    assert driver.prefill(PREFILL_128, 0, prompt, chunk=128) == expected
    assert (len(graphs), graphs.steps) == (1, 0)
    assert driver.prefill(PREFILL_64, 1, prompt, chunk=64) == expected
    assert graphs.steps == 2  # the greedy and the sampled frames' steps


@pytest.mark.parametrize(("sampling", "top", "whole_step"), [
    (GREEDY, 0, True),
    (SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7), 0, True),
    (SamplingParams(temperature=0.8, seed=7), TOP_LOGPROBS, False),
])
def test_greedy_and_sampled_frames_replay_the_whole_step(
        sampling: SamplingParams, top: int, whole_step: bool,
        tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames of greedy or sampled lanes replay the step graph, never the forward graph
    on its own; a frame asking for top alternatives replays the forward and runs the
    rest op by op. Either way the tokens are the op-by-op programs'."""
    prompt = list(range(5, 30))
    eager = _Driver(_engine(tiny_checkpoints["llama"], capture_forward=False), top)
    driver = _Driver(_engine(tiny_checkpoints["llama"], capture_forward=True), top)
    first = []
    for d in (eager, driver):  # a program's first launch captures its graphs
        d.prefill(PREFILL_64, 0, prompt, chunk=64, sampling=sampling)
        first.append(d.decode(DECODE[1], [0]))
    assert first[0] == first[1]
    forwards: list[int] = []
    real_forward = capture.ForwardCapture.forward

    def counted(self: capture.ForwardCapture, *args: Any) -> Any:
        forwards.append(1)
        return real_forward(self, *args)

    monkeypatch.setattr(capture.ForwardCapture, "forward", counted)
    tokens = [driver.decode(DECODE[1], [0]) for _ in range(3)]
    assert tokens == [eager.decode(DECODE[1], [0]) for _ in range(3)]
    assert len(forwards) == (0 if whole_step else 3)


@pytest.mark.slow
def test_every_traced_graph_makes_its_first_call_inside_its_capture(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoints: dict[str, Path]) -> None:
    """Covers DUR-8 (the first positive observation sets the estimate): a traced
    function's first call builds the graph executor's plan and runs several times
    slower than later replays, so capture makes that call itself, inside the time a
    launch subtracts (``tracing_ns``); no launch's device interval, and so no
    single-sample discovery estimate, pays it."""
    monkeypatch.setattr(capture, "_shared_graphs", {})  # trace afresh, not share
    monkeypatch.setenv("FLARE_GRAPH_CACHE", "off")  # nor load
    traced: list[int] = []
    first_call_inside: dict[int, bool] = {}
    inside = [False]
    real_trace = torch.jit.trace

    def trace(fn: Any, example: Any, **kwargs: Any) -> Any:
        graph, index = real_trace(fn, example, **kwargs), len(traced)
        traced.append(index)

        def counted(*args: torch.Tensor) -> torch.Tensor:
            first_call_inside.setdefault(index, inside[0])
            return graph(*args)
        counted.graph = graph.graph  # type: ignore[attr-defined]  # the passes capture runs
        return counted

    real_family = capture.ForwardCapture._capture

    def family(self: capture.ForwardCapture, *args: Any) -> Any:
        inside[0] = True
        try:
            return real_family(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(capture.torch.jit, "trace", trace)
    monkeypatch.setattr(capture.ForwardCapture, "_capture", family)
    driver = ReferenceDriver(_engine(tiny_checkpoints["llama"], capture_forward=True))
    _scenario(driver)
    assert traced, "the scenario traced no graph"
    assert first_call_inside == {index: True for index in traced}


def _lanes_batch(cache: Any, widths: int, lanes: int, *, lane_major: bool) -> PackedBatch:
    """Tokens at positions 3, 9, ... of ``lanes`` lanes (one token each, lane-major as a
    decode; or ``lanes`` tokens of one lane, as a prefill chunk) over ``widths``
    block-table columns of distinct pages."""
    geo = cache.geometry
    tables = torch.arange(lanes * widths).view(lanes, widths).flip(1) % geo.num_pages
    positions = torch.arange(lanes) * 6 + 3
    if lane_major:
        lane = torch.arange(lanes)
    else:
        tables, lane = tables[:1], torch.zeros(lanes, dtype=torch.int64)
    pages = tables[lane, positions // geo.page_size]
    return PackedBatch(token_ids=torch.arange(lanes) + 5, positions=positions,
                       write_slots=pages * geo.page_size + positions % geo.page_size,
                       token_lane=lane, lane_block_tables=tables,
                       lane_major_width=1 if lane_major else 0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_one_graph_replays_every_context_width_bit_for_bit(
        kind: str, tiny_checkpoints: dict[str, Path]) -> None:
    """The context bound (block-table columns) is not part of a graph's key: a graph
    traced at 4 columns replays 1, 2, 7 and 12 columns with the eager forward's hidden
    states and K/V writes, bit for bit, for a decode and a prefill layout."""
    engine = _engine(tiny_checkpoints[kind], capture_forward=False)
    decoder, cache = engine.parts.decoder, engine.parts.cache
    torch.manual_seed(0)
    cache.keys.normal_()
    cache.values.normal_()
    pools = cache.keys.clone(), cache.values.clone()
    for lane_major in (True, False):
        decoder.capture = None
        decoder.enable_capture()
        graphs = decoder.capture
        assert graphs is not None
        for widths in (4, 1, 2, 7, 12):
            batch = _lanes_batch(cache, widths, 2, lane_major=lane_major)
            eager = decoder.forward_eager(batch, cache)
            eager_pools = cache.keys.clone(), cache.values.clone()
            cache.keys.copy_(pools[0])
            cache.values.copy_(pools[1])
            replayed = decoder.forward(batch, cache)
            assert torch.equal(replayed, eager), widths
            assert torch.equal(cache.keys, eager_pools[0])
            assert torch.equal(cache.values, eager_pools[1])
            cache.keys.copy_(pools[0])
            cache.values.copy_(pools[1])
        assert len(graphs) == 1


def test_tracing_time_is_counted_per_thread() -> None:
    """``tracing_ns`` is per thread: a worker's capture never shows in another
    thread's count (each CPU stream subtracts only its own)."""
    before = capture.tracing_ns()
    seen: list[int] = []

    def worker() -> None:
        capture._thread.ns = 5_000
        seen.append(capture.tracing_ns())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [5_000]
    assert capture.tracing_ns() == before


class _TracingProgram:
    """A program whose ``execute`` spends 10 s of (fake) time capturing and 1 s running."""

    shape = GraphShape(kind=GraphKind.DECODE, batch_capacity=1, token_capacity=1,
                       packed_capacity=1)

    def __init__(self, clock: list[int], traced: list[int]) -> None:
        self._clock, self._traced = clock, traced

    def bind(self, inputs: Any) -> None:
        pass

    def execute(self) -> None:
        self._traced[0] += 10_000_000_000
        self._clock[0] += 11_000_000_000

    def read_outputs(self) -> dict[str, Any]:
        return {}


def test_a_launch_that_captured_reports_the_replay_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock, traced = [0], [0]
    monkeypatch.setattr(cpu_backend, "tracing_ns", lambda: traced[0])
    program = _TracingProgram(clock, traced)
    handle = LaunchHandle(program.shape, sequence=0, launched_ns=0)
    cpu_backend.run_launch(cpu_backend._Launch(program, {}, handle),  # type: ignore[arg-type]
                           clock_ns=lambda: clock[0])
    timing = handle.result().timing
    assert timing.device_intervals_ns == (1_000_000_000,)


def test_forward_capture_is_refused_on_cuda(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="forward capture"):
        ModelEngine.load(tiny_checkpoints["llama"], device="cuda", dtype=None,
                         catalog=CATALOG, page_size=PAGE_SIZE, num_pages=8, state_rows=2,
                         execution=ExecutionOptions(capture_forward=True))


def test_a_replay_holds_every_tensor_it_reads_until_it_returns() -> None:
    """The graph's interpreter drops inputs mid-replay without the interpreter lock;
    a held tensor never loses its last C++ reference there, so the replay never
    takes the lock back. Nothing stays held once the call (inputs) or the bound
    graph (weights) is gone."""
    inputs = [torch.zeros(2), torch.zeros(3)]
    weights = [torch.zeros(4), torch.zeros(5)]
    tensors = [*inputs, *weights]
    unheld = [t._use_count() for t in tensors]
    inside: list[int] = []

    def graph(*received: torch.Tensor) -> int:
        assert all(a is b for a, b in zip(received, tensors, strict=True))  # inputs, weights
        inside.extend(t._use_count() for t in received)
        return 7

    bound = capture._BoundGraph(graph, weights)
    assert bound(*inputs) == 7
    assert [count - 1 for count in inside] == unheld
    assert [t._use_count() for t in tensors] == [*unheld[:2], *(n + 1 for n in unheld[2:])]
    del bound
    assert [t._use_count() for t in tensors] == unheld
