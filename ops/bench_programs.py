"""``flare bench programs``: time every prepared program shape on a backend.

Loads a model through ``gpu.engine.ModelEngine``, builds the catalog from the same
flags ``flare run`` takes (``gpu.catalog``), prepares it on the chosen backend, then
launches each shape with a frame that fills its whole capacity (every lane active,
full prompt chunks) and reports the median device interval over repeated runs after
warm-up, the median host wall interval, and tokens per second (tokens the shape
processes per device second). Prints a table and, with ``--json PATH``, writes the
figures with the planning and preparation reports.

Frames reset their rows (``RowInit`` + ``PageAppend``) in ``bind``, outside the timed
device interval, so every repetition runs the same work. Shapes are timed round-robin
(one run of every shape per repetition), so load that drifts while the benchmark runs
(a shared machine) hits every shape alike and side-by-side ratios stay fair.

With ``--speculation draft|copy`` the catalog is a speculative load's (draft depth
``--draft-depth``; ``--speculative-allocation device`` adds the ragged device-allocated
programs): complete speculative rounds (every lane at full width, context ``--context``)
are timed beside decode, and a second table prints, per request bucket (in the
executing thread's CPU time on the cpu backend, which other processes' load disturbs
far less than the device interval), the plain
decode step (what ``--speculation off`` runs), the draft-maintaining decode step (what a
speculative load runs between rounds) and every round's time with its ratio to the
plain decode step. ``--sampled`` makes every lane sample at temperature 1 (default:
greedy, which takes the argmax verification path on the CPU). With ``-tp N`` every
program runs on N ranks and the times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from actors.config import DEFAULT_DRAFT_DIR, DEFAULT_MODEL_DIR
from ops.engine_flags import add_engine_flags

WAIT_S = 600.0


@dataclass(frozen=True, slots=True)
class ShapeTiming:
    label: str
    kind: str
    tokens: int
    device_ms: float
    wall_ms: float
    runs: int
    cpu_ms: float | None = None
    """Median CPU time of the executing thread (cpu backend): unlike the device
    interval it leaves out time the thread waited for a core, so it stays comparable
    on a machine other processes load."""

    @property
    def tokens_per_second(self) -> float | None:
        if self.tokens <= 0 or self.device_ms <= 0:
            return None
        return self.tokens / (self.device_ms / 1000.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.label, "kind": self.kind, "tokens": self.tokens,
            "median_device_ms": round(self.device_ms, 4),
            "median_wall_ms": round(self.wall_ms, 4),
            "median_cpu_ms": round(self.cpu_ms, 4) if self.cpu_ms is not None else None,
            "tokens_per_second": (round(self.tokens_per_second, 1)
                                  if self.tokens_per_second is not None else None),
            "runs": self.runs,
        }


class ThreadTimed:
    """A prepared program that records its executing thread's CPU time per ``execute``
    (cpu backend only: there ``execute`` runs eagerly on the stream's worker thread)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cpu_ns: list[int] = []

    @property
    def shape(self) -> Any:
        return self.inner.shape

    def bind(self, inputs: Any) -> None:
        self.inner.bind(inputs)

    def execute(self) -> None:
        start = time.thread_time_ns()
        self.inner.execute()
        self.cpu_ns.append(time.thread_time_ns() - start)

    def read_outputs(self) -> Any:
        return self.inner.read_outputs()

    def median_ms(self, skip: int) -> float | None:
        samples = self.cpu_ns[skip:]
        return statistics.median(samples) / 1e6 if samples else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser, only=("backend", "tensor_parallel_size"))
    parser.add_argument("--model", type=pathlib.Path, default=DEFAULT_MODEL_DIR,
                        help="HF-format checkpoint directory (default: the embedded model)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="largest decode batch; buckets are the powers of two up to it")
    parser.add_argument("--prefill-capacity", type=int, nargs="+", default=[64, 256, 1024],
                        dest="prefill_capacities", help="prefill chunk capacities (x64)")
    parser.add_argument("--mixed-prefill", action="store_true",
                        help="also prepare and time mixed prefill/decode programs")
    parser.add_argument("--speculative-token-capacity", type=int, default=0,
                        help="target-token envelope R (0: no bound)")
    parser.add_argument("--context", type=int, default=128,
                        help="tokens already cached in each decode lane (default 128)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="context per row (default: min(model limit, 2048))")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per shape")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per shape")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: FLARE_CPU_THREADS, else cores - 1)")
    parser.add_argument("--static-context", action="store_true",
                        help="cpu: run the static (CUDA-style, full max-context) programs "
                             "instead of the eager ones that read only the needed context")
    parser.add_argument("--capture-forward", action="store_true",
                        help="cpu: replay captured decoder forwards, as flare run does")
    parser.add_argument("--json", type=pathlib.Path, default=None, dest="json_path",
                        help="also write the results as JSON here")
    spec = parser.add_argument_group("speculation")
    spec.add_argument("--speculation", choices=("off", "draft", "copy"), default="off",
                      help="also time complete speculative rounds with this proposal source "
                           "and print them beside decode")
    spec.add_argument("--draft-model", type=pathlib.Path, default=DEFAULT_DRAFT_DIR,
                      help="draft checkpoint for --speculation draft (default: the embedded "
                           "draft)")
    spec.add_argument("--draft-depth", type=int, default=4,
                      help="proposal depth D: rounds of widths 1..D+1 are timed")
    spec.add_argument("--speculative-allocation", choices=("host", "device"), default="host",
                      help="device: also time the ragged device-allocated programs")
    spec.add_argument("--sampled", action="store_true",
                      help="lanes sample at temperature 1 (default: greedy)")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where benchmark lanes live: rows 0..max_batch-1 hold decode contexts; one spare
    row and spare pages serve as snapshot/restore destinations."""

    page_size: int
    max_context: int
    max_batch: int
    context: int

    @property
    def blocks(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def spare_row(self) -> int:
        return self.max_batch

    @property
    def state_rows(self) -> int:
        return self.max_batch + 1

    @property
    def num_pages(self) -> int:
        return self.state_rows * self.blocks + 2

    def pages_of(self, row: int, tokens: int) -> tuple[int, ...]:
        count = -(-tokens // self.page_size)
        return tuple(row * self.blocks + i for i in range(count))

    @property
    def spare_pages(self) -> tuple[int, int]:
        base = self.state_rows * self.blocks
        return base, base + 1


def _reset(row: int, position: int, extent: int, layout: Layout,
           sampling: Any = None) -> tuple[Any, ...]:
    """Updates that give ``row`` a fresh context of ``position`` cached tokens with pages
    for ``extent`` tokens (greedy unless ``sampling`` is given), asking for no top
    alternatives, as a request without ``logprobs`` does."""
    from gpu.frames import GREEDY, PageAppend, RowInit

    pages = layout.pages_of(row, max(extent, 1))
    return (RowInit(row=row, position=position, pending_token=5,
                    sampling=sampling or GREEDY, top_logprobs=0),
            PageAppend(row=row, first_block=0, page_ids=pages))


def query_lengths(batch: int, width: int, rows: int) -> tuple[int, ...]:
    """Host lengths filling ``rows`` target rows over ``batch`` lanes of width ``width``:
    one row each, the rest spread over the lanes in slot order."""
    lengths = [1] * batch
    extra = rows - batch
    for lane in range(batch):
        grow = min(width - 1, max(extra, 0))
        lengths[lane] += grow
        extra -= grow
    return tuple(lengths)


def speculative_frame(shape: Any, layout: Layout, sampling: Any = None,
                      prompt: tuple[int, ...] = ()) -> tuple[Any, int]:
    """A complete speculative round (or a wider speculative mixed frame, whose lane 0
    carries the ``prompt`` chunk) over every lane at full width, and the target rows
    it verifies (plus the chunk)."""
    from gpu.programs.speculative_frames import SpeculativeFrame, SpeculativeMixedFrame
    from policy.descriptors import GraphKind, TargetBinding

    b, w, ctx = shape.batch_capacity, shape.token_capacity, layout.context
    if shape.kind is GraphKind.MIXED:
        updates = _reset(0, 0, len(prompt), layout, sampling) + tuple(
            u for r in range(1, b) for u in _reset(r, ctx, ctx + w, layout, sampling))
        mixed = SpeculativeMixedFrame(
            rows=tuple(range(b)), limits=(0,) + (w,) * (b - 1), prefill_row=0,
            prompt_tokens=prompt, prompt_start=0, prompt_ends=True, updates=updates)
        return mixed, len(prompt) + (b - 1) * w
    rows = tuple(range(b))
    if shape.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT:
        limits, verified = (w,) * b, shape.max_packed_extent  # ceilings; P rows run
    else:
        limits = query_lengths(b, w, shape.max_packed_extent)
        verified = sum(limits)
    updates = tuple(u for r in rows for u in _reset(r, ctx, ctx + w, layout, sampling))
    return SpeculativeFrame(rows=rows, limits=limits, updates=updates), verified


def benchmark_frame(shape: Any, layout: Layout, vocab: int,
                    sampling: Any = None) -> tuple[Any, int]:
    """A frame that fills ``shape`` and the number of tokens it processes."""
    from gpu import frames as f
    from policy.descriptors import GraphKind, StateOp

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(3 + (i * 7919) % max(vocab - 3, 1) for i in range(n))

    kind, ctx = shape.kind, layout.context
    if kind is GraphKind.SPECULATIVE or (kind is GraphKind.MIXED and shape.token_capacity > 1):
        return speculative_frame(shape, layout, sampling, prompt(shape.prefill_capacity))
    if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        c = shape.token_capacity
        frame = f.PrefillFrame(row=0, tokens=prompt(c), start_position=0, ends_prompt=True,
                               updates=_reset(0, 0, c, layout))
        return frame, c
    if kind is GraphKind.DECODE:
        rows = tuple(range(shape.batch_capacity))
        updates = tuple(u for r in rows for u in _reset(r, ctx, ctx + 1, layout, sampling))
        return f.DecodeFrame(rows=rows, updates=updates), len(rows)
    if kind is GraphKind.MIXED:
        rows = tuple(range(shape.batch_capacity))
        p = shape.prefill_capacity
        updates = _reset(0, 0, p, layout, sampling) + tuple(
            u for r in rows[1:] for u in _reset(r, ctx, ctx + 1, layout, sampling))
        mixed = f.MixedFrame(rows=rows, prefill_row=0, prompt_tokens=prompt(p), prompt_start=0,
                             prompt_ends=True, updates=updates)
        return mixed, p + len(rows) - 1
    if kind is GraphKind.STATE:
        spare_a, spare_b = layout.spare_pages
        partial = ctx + 3  # a partial last page, copied by value
        if shape.state_op is StateOp.SNAPSHOT:
            return f.StateOpFrame(copies=(f.RowCopy(src_row=0, dst_row=layout.spare_row,
                                                    dst_page=spare_a),),
                                  updates=_reset(0, partial, partial, layout)), 0
        if shape.state_op is StateOp.RESTORE:
            return f.StateOpFrame(copies=(f.RowCopy(src_row=layout.spare_row, dst_row=0,
                                                    dst_page=spare_b),),
                                  updates=_reset(layout.spare_row, partial, partial, layout)), 0
        if shape.state_op is StateOp.PAGE_COPY:
            return f.StateOpFrame(page_pairs=((0, spare_a),)), 0
        return f.StateOpFrame(updates=_reset(0, ctx, ctx, layout)), 0
    raise ValueError(f"no benchmark frame for {shape.label()}")


def time_shape(backend: Any, program: Any, inputs: dict[str, Any], *, warmup: int,
               repeats: int) -> tuple[float, float]:
    """Median device and wall milliseconds of ``repeats`` runs after ``warmup`` runs."""
    (device, wall), = time_round_robin(backend, [(program, inputs)], warmup=warmup,
                                       repeats=repeats)
    return device, wall


def time_round_robin(backend: Any, jobs: list[tuple[Any, dict[str, Any]]], *, warmup: int,
                     repeats: int) -> list[tuple[float, float]]:
    """Median device and wall milliseconds per ``(program, inputs)`` job: ``warmup``
    untimed rounds, then ``repeats`` timed rounds of one run of every job in turn."""
    device: list[list[float]] = [[] for _ in jobs]
    wall: list[list[float]] = [[] for _ in jobs]
    for i in range(warmup + repeats):
        for j, (program, inputs) in enumerate(jobs):
            handle = backend.launch(program, inputs)
            if not handle.wait(WAIT_S):
                raise TimeoutError(f"{program.shape.label()} did not finish in {WAIT_S}s")
            timing = handle.result().timing
            if i >= warmup:
                device[j].append(timing.device_ns / 1e6)
                wall[j].append(timing.wall_ns / 1e6)
    return [(statistics.median(d), statistics.median(w)) for d, w in zip(device, wall,
                                                                       strict=True)]


def format_table(rows: list[ShapeTiming]) -> str:
    width = max([34, *(len(r.label) for r in rows)])
    head = f"{'shape':<{width}} {'device ms':>10} {'wall ms':>10} {'tokens/s':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        tps = f"{r.tokens_per_second:,.0f}" if r.tokens_per_second is not None else "-"
        lines.append(f"{r.label:<{width}} {r.device_ms:>10.3f} {r.wall_ms:>10.3f} {tps:>12}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import torch

    from gpu.backends import open_backend
    from gpu.backends.protocol import BackendUnavailable
    from gpu.catalog import CatalogError, CatalogFlags, ModelDims, plan_catalog
    from gpu.engine import ModelEngine, resolve_dtype
    from gpu.frames import SamplingParams, as_inputs
    from gpu.model.config import load_model_config
    from gpu.preparation import prepare_catalog
    from gpu.programs.execution import ExecutionOptions
    from ops.bench_programs_speculative import format_comparison, speculative_comparison
    from policy.descriptors import GraphKind

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    model_dir: pathlib.Path = args.model
    if not (model_dir / "config.json").is_file():
        print(f"flare bench programs: no checkpoint in {model_dir} (config.json missing)",
              file=sys.stderr)
        return 2
    config = load_model_config(model_dir)
    family_mixed = config.mixed_capture  # the family's declaration (CAT-13, OPEN-25)
    speculative = args.speculation != "off"
    if speculative and args.speculation == "draft" and not (
            args.draft_model / "config.json").is_file():
        print(f"flare bench programs: no draft checkpoint in {args.draft_model}",
              file=sys.stderr)
        return 2
    if speculative and not 1 <= args.draft_depth <= 7:
        print("flare bench programs: --draft-depth must be 1..7", file=sys.stderr)
        return 2
    flags = CatalogFlags(
        max_batch=args.max_batch, prefill_capacities=tuple(args.prefill_capacities),
        mixed_prefill=args.mixed_prefill, family_supports_mixed=family_mixed,
        speculative_token_capacity=args.speculative_token_capacity,
        draft_depth=args.draft_depth if speculative else 0,
        device_allocation=speculative and args.speculative_allocation == "device",
    )
    sampling = SamplingParams(temperature=1.0, seed=7) if args.sampled else None
    try:
        # cpu: --threads, else default_cpu_threads(); on a thread here (ThreadTimed clocks)
        # -tp N: N ranks, device processes (timed by the ranks' intervals)
        options = ({"num_threads": args.threads, "device_process": False,
                    "tensor_parallel": args.tensor_parallel_size}
                   if args.backend == "cpu" else {})
        backend = open_backend(args.backend, **options)
    except BackendUnavailable as exc:
        print(f"flare bench programs: {exc}", file=sys.stderr)
        return 2
    try:
        dtype = resolve_dtype(backend.device, None, config.torch_dtype)
        dims = ModelDims(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
            dtype_bytes=torch.finfo(dtype).bits // 8,
        )
        try:
            plan = plan_catalog(flags, dims)
        except CatalogError as exc:
            print(f"flare bench programs: {exc}", file=sys.stderr)
            return 2
        max_context = args.max_context or min(config.max_context, 2048)
        layout = Layout(page_size=args.page_size, max_context=max_context,
                        max_batch=args.max_batch, context=args.context)
        too_long = [c for c in flags.prefill_capacities if c > max_context]
        if too_long or args.context + 4 > max_context:
            print(f"flare bench programs: context {max_context} is too short for "
                  f"capacities {too_long or ''} / --context {args.context}", file=sys.stderr)
            return 2
        print(plan.summary())
        engine = ModelEngine.load(
            model_dir, device=backend.device, dtype=dtype, catalog=plan.catalog.shapes,
            page_size=layout.page_size, num_pages=layout.num_pages,
            state_rows=layout.state_rows, max_context=max_context, require_tokenizer=False,
            execution=(ExecutionOptions.static() if args.static_context else
                       ExecutionOptions.for_device(backend.device,
                                                   capture_forward=args.capture_forward)),
            speculation_source=args.speculation if speculative else None,
            draft_model_dir=args.draft_model if args.speculation == "draft" else None,
            hold_model=args.tensor_parallel_size == 1,  # ranks read their own shards
        )
        timed = args.backend == "cpu" and args.tensor_parallel_size == 1
        programs = {s: ThreadTimed(engine.programs[s]) if timed else engine.programs[s]
                    for s in plan.catalog}
        # its progress sink prints the summary
        report = prepare_catalog(backend, list(programs.values()))
        jobs = []
        for shape in plan.catalog:
            frame, tokens = benchmark_frame(shape, layout, config.vocab_size, sampling)
            jobs.append((programs[shape], as_inputs(frame), tokens))
        # a speculative load wraps decode to keep the draft context: also time the plain
        # decode step inside (what --speculation off runs)
        plain: dict[Any, Any] = {}
        # (a device process is prepared once: not under -tp)
        for shape in plan.catalog.of_kind(GraphKind.DECODE) if speculative and timed else ():
            inner = getattr(engine.programs[shape], "inner", None)
            if inner is not None:
                plain[shape] = ThreadTimed(inner) if timed else inner
        if plain:
            backend.prepare(list(plain.values()))
        for shape, program in plain.items():
            frame, tokens = benchmark_frame(shape, layout, config.vocab_size, sampling)
            jobs.append((program, as_inputs(frame), tokens))
        timings = time_round_robin(backend, [(p, i) for p, i, _ in jobs],
                                   warmup=args.warmup, repeats=args.repeats)
        results = [ShapeTiming(p.shape.label(), p.shape.kind.value, tokens, device_ms,
                               wall_ms, args.repeats,
                               p.median_ms(args.warmup) if isinstance(p, ThreadTimed) else None)
                   for (p, _, tokens), (device_ms, wall_ms) in zip(jobs, timings, strict=True)]
        plain_results = results[len(plan.catalog):]
        results = results[:len(plan.catalog)]
    finally:
        backend.close()
    mode = "eager (dynamic context)" if engine.execution.host_bounds else "static"
    threads = (f"{args.tensor_parallel_size} ranks x {backend.num_threads} torch threads"
               if args.tensor_parallel_size > 1 else f"torch threads: {torch.get_num_threads()}")
    print(f"execution: {mode}; {threads}")
    print(format_table(results))
    comparison = speculative_comparison(plan.catalog, results, plain_results)
    if speculative:
        clock = "thread CPU" if timed else "device"
        print(f"\nspeculative rounds vs decode ({args.speculation} proposals, "
              f"{'sampled' if args.sampled else 'greedy'} lanes, context {args.context}; "
              f"median {clock} ms per round, x = round / plain decode step)")
        print(format_comparison(comparison))
    if args.json_path is not None:
        payload = {
            "model": str(model_dir), "backend": args.backend,
            "torch_threads": torch.get_num_threads(),
            "execution": "eager" if engine.execution.host_bounds else "static",
            "warmup": args.warmup, "repeats": args.repeats, "context": args.context,
            "plan": plan.to_json(), "preparation": report.to_json(),
            "results": [r.to_json() for r in results],
        }
        if speculative:
            payload["speculation"] = {
                "source": args.speculation, "draft_depth": args.draft_depth,
                "sampled": args.sampled, "buckets": comparison}
        args.json_path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0
