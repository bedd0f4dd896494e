"""CPU capture of the decoder forward: one traced graph per input shape.

On CUDA a prepared program is captured into a graph and replayed; the replay holds no
Python lock, so the host can plan the next frame while the device runs this one
(architecture: *Two frame slots, device-resident feedback*). The CPU backend runs
``execute`` on a worker thread, and an eager forward dispatches each of its few hundred
small torch ops from Python: between ops the worker must take the interpreter lock
back from the trio thread, so host planning and publication serialise with the
forward instead of overlapping it (``docs/runtime.md``, *Benchmark*).

``ForwardCapture`` is the CPU counterpart of a graph capture: the first forward of each
input shape is traced once (``torch.jit.trace``) into a TorchScript graph whose
interpreter runs the whole forward in C++ with the lock released (every tensor it reads
held by flare for the replay, ``_BoundGraph``: an input the interpreter let go of
mid-replay would take the lock back). Later forwards of
that shape replay the graph. Inputs are the packed-batch index tensors, the page
pools (written in place through the graph, exactly as the eager forward writes them)
and the weights: torch keeps every traced function for the life of the process, so a
graph holds no tensor of its own and is shared by every decoder of the same model
geometry (``shared_graphs``), and saved on disk for the next process of the same
model (``gpu.model.graph_cache``: a loaded graph replaces the trace). The traced graph
runs the same aten operations in the same order as the eager forward, and the graph
executor's optimisations are switched off (no fusion), so the outputs are
bit-identical (tests check it).

Shapes follow the program's fixed buffers. The one shape that varies from launch to
launch, the number of block-table columns the attention reads (the host-chosen context
bound, ``gpu.programs.execution.context_blocks``), is not part of a graph's key: the
tracer records the gather, the masks and the attention in terms of the table's width,
so a graph traced at one width replays any other, bit for bit (tests check every model
family at widths above and below the traced one). A program therefore traces one graph
at its first launch (a few eager forwards), whatever contexts follow. Capture time is
preparation: ``tracing_ns`` lets the CPU backend leave it out of the launch's execution
interval. It includes one warm-up replay per graph: a traced function's first call
builds the executor's plan and runs two to four times slower than later replays, and a
program's discovery estimate is one sample.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gpu.model.batch import PackedBatch, PhaseSplit
from gpu.model.graph_cache import GraphCache
from gpu.model.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from gpu.model.decoder import Decoder

__all__ = ["ForwardCapture", "tracing_ns"]

_GraphKey = tuple[object, ...]

_thread = threading.local()

_shared_graphs: dict[tuple[object, ...], Callable[..., torch.Tensor]] = {}
_shared_lock = threading.Lock()


def shared_graphs() -> int:
    """Graphs traced in this process so far (each kept for the process's life)."""
    with _shared_lock:
        return len(_shared_graphs)


def tracing_ns() -> int:
    """Nanoseconds this thread has spent tracing graphs so far.

    Tracing is preparation, not execution: the CPU backend subtracts what a launch
    spent tracing from its execution interval, so the first launch of a shape reports
    what its replays cost and the scheduler's duration estimates are not inflated by a
    one-off capture (seed: *Duration estimates*)."""
    return int(getattr(_thread, "ns", 0))


class ForwardCapture:
    """Traced forwards of one decoder, keyed by the shapes of their inputs."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._model: tuple[list[torch.Tensor], tuple[object, ...]] | None = None
        """``_weights`` and ``_model_key``, fixed at the first graph."""
        self._graphs: dict[_GraphKey, Callable[..., torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.traced = 0
        """How many graphs this decoder traced; shapes another decoder of the same
        model already traced reuse its graph (``shared_graphs``)."""
        self.loaded = 0
        """How many graphs this decoder loaded from the disk cache instead."""
        self._bodies: dict[_GraphKey, Callable[..., Any]] = {}
        """Traced program steps (``replay``), apart from the forwards."""
        self.disk = GraphCache.from_environment()
        """Where traced graphs are kept across processes (``gpu.model.graph_cache``);
        None: nowhere."""

    @property
    def _weights(self) -> list[torch.Tensor]:
        """The decoder's tensors, fed to every graph after its inputs (its packed
        projections included: the first graph packs them in this process)."""
        return self._weights_and_key()[0]

    @property
    def _model_key(self) -> tuple[object, ...]:
        """What a shared graph depends on besides its input shapes."""
        return self._weights_and_key()[1]

    def _weights_and_key(self) -> tuple[list[torch.Tensor], tuple[object, ...]]:
        if self._model is None:
            decoder = self._decoder
            decoder.pack_projections()
            weights = _weights_of(decoder)
            self._model = (weights, (decoder.config, decoder.dtype, tuple(sorted(decoder.packed)),
                                     *(tuple(w.shape) for w in weights)))
        return self._model

    def __len__(self) -> int:
        """Graphs this decoder replays: forwards and program steps (``replay``)."""
        return len(self._graphs) + len(self._bodies)

    @property
    def steps(self) -> int:
        """How many of them are program steps (``replay``)."""
        return len(self._bodies)

    def forward(self, batch: PackedBatch, cache: PagedKVCache) -> torch.Tensor:
        """The decoder's forward through the graph for these input shapes, traced at
        the first forward of a shape (``_capture``)."""
        key, tensors = _signature(batch, cache)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(self._graphs, key,
                                  lambda: self._trace(key, tensors, batch, cache))
        with torch.jit.optimized_execution(False):  # type: ignore[attr-defined]
            return graph(*tensors)

    def replay(self, key: _GraphKey, tensors: list[torch.Tensor], cache: PagedKVCache,
               body: Callable[..., Any], *, prepare: Callable[[], object] | None = None,
               trace_only: bool = False) -> Any:
        """``body(decoder, cache, *tensors)`` through the graph of ``key``, traced at
        its first call: a whole program step (``gpu.programs.step_body``) run without
        the interpreter. ``key`` names everything ``body`` branches on, the source of
        the modules it runs beyond ``gpu.model`` (``graph_cache.source_digest``) and
        every input shape the graph does not follow; ``body`` must leave the same state
        however often it runs (tracing, the warm-up replay and a loaded graph's check
        run it too). Body graphs are shared and kept on disk like forward graphs.
        ``prepare`` runs before a trace, counted as tracing time: what else the first
        call should capture (the program's fallback forward graphs); what it returns,
        if not None, is ``body``'s outputs, the reference a loaded graph is checked
        against. ``trace_only``:
        make sure the graph is captured (its trace and warm-up run ``body``), return
        None without another replay."""
        graph = self._bodies.get(key)
        inputs = [*tensors, cache.keys, cache.values]
        if graph is None:
            reference = None
            if prepare is not None:
                started, before = time.perf_counter_ns(), tracing_ns()
                reference = prepare()  # its own captures count once, in this interval
                _thread.ns = before + time.perf_counter_ns() - started
            graph = self._capture(self._bodies, key, lambda: self._trace_body(
                key, inputs, cache, body, reference))
        if trace_only:
            return None
        with torch.jit.optimized_execution(False):  # type: ignore[attr-defined]
            return graph(*inputs)

    def _capture(self, graphs: dict[_GraphKey, Callable[..., Any]], key: _GraphKey,
                 trace: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """Trace (or share) the graph of ``key``, counting the time in ``tracing_ns``."""
        started = time.perf_counter_ns()
        with self._lock:
            graph = graphs.get(key)
            if graph is None:
                graph = trace()
        _thread.ns = tracing_ns() + time.perf_counter_ns() - started
        return graph

    def _trace_body(self, key: _GraphKey, inputs: list[torch.Tensor], cache: PagedKVCache,
                    body: Callable[..., Any], reference: Any = None) -> Callable[..., Any]:
        """Trace one body graph and replay it once (the caller holds the lock)."""
        shared_key = ("body", *self._model_key, *key)
        reused = self._reused(self._bodies, key, shared_key, lambda loaded:
                              self._body_replays_eagerly(loaded, inputs, cache, body, reference))
        if reused is not None:
            return reused
        decoder, geometry, count = self._decoder, cache.geometry, len(inputs)

        def run(*args: torch.Tensor) -> Any:
            view = PagedKVCache.over(geometry, args[count - 2], args[count - 1])
            return body(_with_weights(decoder, args[count:]), view, *args[:count - 2])

        return self._kept(self._bodies, key, shared_key, _traced(run, (*inputs, *self._weights)))

    def _body_replays_eagerly(self, graph: Callable[..., Any], inputs: list[torch.Tensor],
                              cache: PagedKVCache, body: Callable[..., Any],
                              reference: Any = None) -> bool:
        """Whether a loaded body graph's outputs equal the op-by-op body's (or
        ``reference``, outputs of the same inputs), bit for bit (its first call, the
        warm-up of ``_traced``)."""
        try:
            with torch.jit.optimized_execution(False):  # type: ignore[attr-defined]
                replayed = graph(*inputs, *self._weights)
        except Exception:  # a graph of other inputs: trace instead
            return False
        eager = (reference if reference is not None else
                 body(_with_weights(self._decoder, self._weights), cache, *inputs[:-2]))
        return len(replayed) == len(eager) and all(
            torch.equal(a, b) for a, b in zip(replayed, eager, strict=True))

    def _trace(self, key: _GraphKey, tensors: list[torch.Tensor], batch: PackedBatch,
               cache: PagedKVCache) -> Callable[..., torch.Tensor]:
        """Trace one graph and replay it once (the caller holds the lock). Tracing and
        the warm-up replay run the forward: each writes the same K/V at the same slots
        as the replay that follows, so the pools end as one eager forward leaves them."""
        decoder = self._decoder
        width = batch.lane_major_width
        split = batch.phase_split
        split_width = 0 if split is None else split.width
        has_prompt_table = split is not None and split.prompt_block_table is not None
        geometry = cache.geometry

        # The weights are graph *inputs*, not constants (constants would keep each
        # engine's weights alive with a graph torch never frees), so one graph serves
        # every decoder with the same model key and input shapes.
        weights = self._weights
        count = len(tensors)
        shared_key = (*self._model_key, *key)
        reused = self._reused(self._graphs, key, shared_key, lambda loaded:
                              self._replays_eagerly(loaded, tensors, batch, cache))
        if reused is not None:
            return reused

        def run(*args: torch.Tensor) -> torch.Tensor:
            ids, pos, slots, lane, tables = args[:5]
            rest = list(args[5:count])
            phase = None
            if split is not None:
                prompt_slots, prompt_lane, decode_slots = rest[:3]
                prompt_table = rest[3] if has_prompt_table else None
                phase = PhaseSplit(prompt_slots=prompt_slots, prompt_lane=prompt_lane,
                                   decode_slots=decode_slots, width=split_width,
                                   prompt_block_table=prompt_table)
            keys, values = rest[-2], rest[-1]
            view = PagedKVCache.over(geometry, keys, values)
            return _with_weights(decoder, args[count:]).forward_eager(
                PackedBatch(token_ids=ids, positions=pos, write_slots=slots,
                            token_lane=lane, lane_block_tables=tables,
                            lane_major_width=width, phase_split=phase),
                view)

        return self._kept(self._graphs, key, shared_key, _traced(run, (*tensors, *weights)))

    def _reused(self, graphs: dict[_GraphKey, Callable[..., Any]], key: _GraphKey,
                shared_key: tuple[Any, ...], replays_eagerly: Callable[[Callable[..., Any]], bool],
                ) -> Callable[..., Any] | None:
        """The graph another decoder of the same model traced, else one kept on disk
        whose first replay ``replays_eagerly`` accepts, bound for ``key``; None: trace."""
        with _shared_lock:
            shared = _shared_graphs.get(shared_key)
        if shared is not None:
            return self._bind(graphs, key, shared)
        if self.disk is not None:
            loaded = self.disk.load(shared_key)
            if loaded is not None and replays_eagerly(loaded):
                with _shared_lock:
                    _shared_graphs[shared_key] = loaded
                self.loaded += 1
                return self._bind(graphs, key, loaded)
        return None

    def _kept(self, graphs: dict[_GraphKey, Callable[..., Any]], key: _GraphKey,
              shared_key: tuple[Any, ...], traced_run: Callable[..., Any]) -> Callable[..., Any]:
        """A freshly traced graph, shared process-wide, saved to disk and bound for ``key``."""
        with _shared_lock:
            _shared_graphs[shared_key] = traced_run
        self.traced += 1
        if self.disk is not None:
            self.disk.save(shared_key, traced_run)
        return self._bind(graphs, key, traced_run)

    def _replays_eagerly(self, graph: Callable[..., torch.Tensor], tensors: list[torch.Tensor],
                         batch: PackedBatch, cache: PagedKVCache) -> bool:
        """Whether a loaded graph's replay equals the op-by-op forward, bit for bit
        (its first call, the warm-up of ``_trace``). Both write the same K/V at the
        same slots, the op-by-op forward last."""
        try:
            with torch.jit.optimized_execution(False):  # type: ignore[attr-defined]
                replayed = graph(*tensors, *self._weights)
        except Exception:  # a graph of other inputs: trace instead
            return False
        return torch.equal(replayed, self._decoder.forward_eager(batch, cache))

    def _bind(self, graphs: dict[_GraphKey, Callable[..., Any]], key: _GraphKey,
              graph: Callable[..., Any]) -> Callable[..., Any]:
        """This decoder's graph for ``key``: ``graph`` fed its own weights."""
        bound = _BoundGraph(graph, self._weights)
        graphs[key] = bound
        return bound


class _BoundGraph:
    """A shared graph fed one decoder's weights, every tensor it reads held by a C++
    reference of flare's own for the whole replay.

    A tensor that Python also holds keeps its Python object alive from C++ whenever C++
    holds a reference besides the object's own; when that second reference goes, torch
    releases the object, which takes the interpreter lock. The graph's interpreter
    drops each input after its last use, mid-replay and without the lock, so an
    unheld input would make the replay wait for the lock once per input, behind
    whatever Python another thread of the process runs (on the in-process stream, the
    trio thread planning the next frame). Holding the weights for the graph's life and
    the call's inputs for the call keeps every drop inside the replay short of that
    last reference; the held inputs are let go after the graph returns, with the lock
    already held."""

    __slots__ = ("_graph", "_weights", "_weights_held")

    def __init__(self, graph: Callable[..., Any], weights: list[torch.Tensor]) -> None:
        self._graph = graph
        self._weights = weights
        self._weights_held = _held(weights)

    def __call__(self, *args: torch.Tensor) -> Any:
        inputs_held = _held(args)
        try:
            return self._graph(*args, *self._weights)
        finally:
            del inputs_held


def _held(tensors: Sequence[torch.Tensor]) -> object:
    """One C++ reference to each of ``tensors``, kept while the returned list lives."""
    return torch._C.ScriptList(list(tensors))


def _traced(run: Callable[..., Any], example: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
    """``run`` traced over ``example`` and called once."""
    with warnings.catch_warnings():
        # The forward branches only on shapes and flags, all part of the key; the
        # tracer's warnings about shape-to-int conversions do not apply.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # type: ignore[attr-defined]
        # Deprecated in favour of torch.compile / torch.export, neither of which
        # yields a graph that runs without the interpreter lock (torch is pinned).
        warnings.filterwarnings("ignore", category=DeprecationWarning,
                                message=r".*torch\.jit\.trace")
        traced_run: Callable[..., Any] = torch.jit.trace(  # type: ignore[no-untyped-call]
            run, example, check_trace=False)
    # The tracer records every shape read as its own size/int conversion nodes (a
    # hundred per step graph); merging identical pure nodes (alias-aware: nothing that
    # reads a mutated pool moves) halves what the interpreter walks per replay and
    # leaves every aten op that computes a value as it was.
    torch._C._jit_pass_cse(traced_run.graph)  # type: ignore[attr-defined]
    # The first call of a traced function builds the graph executor's plan and runs
    # two to four times slower than later replays. Make that call here, inside the
    # capture's time, so no launch (and no duration estimate) pays it: a shape's
    # discovery sample is a single observation (seed: *Duration estimates*). It
    # writes the same K/V at the same slots as the trace did, so the pools are
    # unchanged.
    with torch.jit.optimized_execution(False):  # type: ignore[attr-defined]
        traced_run(*example)
    return traced_run


def _weights_of(decoder: Decoder) -> list[torch.Tensor]:
    """Every tensor ``Decoder.forward_eager`` reads besides its inputs, in the order
    ``_with_weights`` takes them back."""
    biases = [b for b in decoder.qkv_bias if b is not None]
    return [decoder.embed, decoder.rope_cos, decoder.rope_sin, *decoder.qkv_weight,
            *biases, *decoder.gate_up_weight, *(decoder.w[k] for k in sorted(decoder.w)),
            *(decoder.packed[k] for k in sorted(decoder.packed))]


def _with_weights(decoder: Decoder, tensors: Sequence[torch.Tensor]) -> Decoder:
    """A shallow copy of ``decoder`` reading ``tensors`` (``_weights_of`` order): how
    the traced forward sees the weights it receives as graph inputs."""
    layers = len(decoder.qkv_weight)
    it = iter(tensors)
    view = copy.copy(decoder)
    view.embed, view.rope_cos, view.rope_sin = next(it), next(it), next(it)
    view.qkv_weight = [next(it) for _ in range(layers)]
    view.qkv_bias = [None if b is None else next(it) for b in decoder.qkv_bias]
    view.gate_up_weight = [next(it) for _ in range(layers)]
    view.w = {k: next(it) for k in sorted(decoder.w)}
    view.packed = {k: next(it) for k in sorted(decoder.packed)}
    view.capture = None  # a traced body runs the forward op by op, inside its graph
    view.lm_head = (view.embed if decoder.lm_head is decoder.embed
                    else view.w["lm_head.weight"])
    return view


def _signature(batch: PackedBatch, cache: PagedKVCache
               ) -> tuple[_GraphKey, list[torch.Tensor]]:
    """The graph key of a forward (every shape and flag its code branches on) and its
    graph inputs in order."""
    split = batch.phase_split
    tensors = [batch.token_ids, batch.positions, batch.write_slots, batch.token_lane,
               batch.lane_block_tables]
    has_prompt_table = False
    if split is not None:
        tensors += [split.prompt_slots, split.prompt_lane, split.decode_slots]
        if split.prompt_block_table is not None:
            tensors.append(split.prompt_block_table)
            has_prompt_table = True
    tensors += [cache.keys, cache.values]
    tables = {id(batch.lane_block_tables)}
    if has_prompt_table and split is not None:
        tables.add(id(split.prompt_block_table))
    key: _GraphKey = (
        batch.lane_major_width,
        -1 if split is None else split.width,
        has_prompt_table,
        cache.geometry,
        # a block table's width (the context bound) is not part of the key: the graph
        # follows it (module docstring)
        *((t.shape[0],) if id(t) in tables else tuple(t.shape) for t in tensors),
    )
    return key, tensors
