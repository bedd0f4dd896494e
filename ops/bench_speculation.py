"""``flare bench speculation``: speculative decoding modes side by side.

Opens the whole runtime (``open_runtime``: the actors, the real scheduler, the real
model on the chosen backend) once per mode -- no speculation, each fixed proposal depth,
adaptive -- for each draft source, and drives ``rt.generate`` directly (no HTTP) with
greedy requests whose prompts are fixed text from Python standard-library docstrings.
Each load measures a warmed server: short requests first discover every program's
duration (the one-time start-up cost, DUR-22), then ``--warm-up-requests`` full-length
requests per stream on prompts that are never measured (duration estimates and the
population acceptance priors see this traffic, as in a server that has been serving
it; 0 measures a cold start), then each stream sends ``--requests-per-stream``
measured requests one after another. For each mode and each load (number of
concurrent streams: one stream and saturation) it prints output tokens per second and
the mean inter-token latency (per request: time from its first to its last output
token divided by the tokens after the first; then averaged over requests), with the
draft acceptance rate and the share of speculative programs among those run (both over
the measured load). The seed's target ("Speculative decoding"): adaptive is at least as
good as the best fixed choice, including none, at every load, and strictly better than
no speculation at one stream; ``ops.bench_verdicts`` prints it under the table, also
with the best fixed choice picked on held-out repeats when ``--repeats`` is 2 or more.

With ``--tiny`` it builds a random tiny Llama pair in a temporary directory.
``--scheduler-policy throughput`` runs every mode under the seed's throughput preset
(token value only); the default is ``balanced``, as ``flare run``.
``--adaptive-policies balanced,throughput`` runs each adaptive mode under both presets
in the same run (labels ``...,balanced`` and ``...,throughput``): the balanced preset's
delivery and output-age prices trade tokens per second for delivery cadence, which the
``gap ms`` column (mean time between a request's visible bursts) shows beside ``ITL ms``
(mean time per token). ``--repeats N`` runs
the modes N times, interleaved, and prints each cell's median.

``--diagnose`` also prints, per mode and load (from ``rt.frame_log()``,
``rt.statistics()`` and a timer around ``rt.scheduler.plan``): frames and output
tokens per frame, the share of frames launched only after the previous frame was
observed (the window ran empty) with the mean gap, device-busy share of the load's
span, ``plan()`` calls per frame with mean wall and thread-CPU time per call, and the
programs run with each one's median device interval and the scheduler's duration
estimate for it at the end of the load. These separate host cost (planning, empty
windows) from the choices, and show where estimates lag the machine's speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import structlog
import trio

from actors.config import (
    DEFAULT_DRAFT_CATCH_UP,
    DEFAULT_DRAFT_DIR,
    DEFAULT_MODEL_DIR,
    RuntimeConfig,
)
from actors.public import (
    Finished,
    GenerationRequest,
    RuntimeStatistics,
    SamplingParams,
    TokenDelta,
)
from actors.system import Runtime, open_runtime
from ops.bench_speculation_rows import Mode, Row, median_rows, render
from ops.bench_verdicts import held_out_verdicts
from ops.engine_flags import add_engine_flags, engine_config
from ops.tiny_model import TinyLlama, write_tiny_pair
from ops.training.llama import LlamaShape

PROMPT_MODULES = ("argparse", "json", "heapq", "difflib", "pickle", "csv", "random", "string",
                  "collections", "typing", "statistics", "calendar", "configparser", "ftplib",
                  "smtplib", "pdb")
"""Standard-library modules whose docstrings are the measured prompts (request ``k`` of
a load uses module ``k`` mod 16)."""
WARM_UP_MODULES = ("doctest", "unittest", "sched", "subprocess", "tokenize", "inspect", "ast",
                   "optparse")
"""Prompts of the full-length warm-up requests (never measured)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help="target model directory (default: the embedded model)")
    parser.add_argument("--draft-model", type=Path, default=DEFAULT_DRAFT_DIR,
                        help="learned draft model directory (default: the embedded draft)")
    parser.add_argument("--tiny", action="store_true",
                        help="build a random tiny Llama pair in a temp dir instead")
    add_engine_flags(parser)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--loads", default="1,8",
                        help="comma-separated concurrent stream counts (default 1,8)")
    parser.add_argument("--depths", default="1,2,3,4",
                        help="fixed proposal depths; adaptive uses the largest (default 1,2,3,4)")
    parser.add_argument("--sources", default="draft,copy",
                        help="draft sources to compare: draft, copy or both (default both)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="measured requests each stream sends one after another, each "
                             "with its own prompt (default 2)")
    parser.add_argument("--warm-up-requests", type=int, default=1,
                        help="full-length requests per stream, on prompts never measured, "
                             "after shape discovery and before the measured load: a server "
                             "that has been serving this traffic (duration estimates, the "
                             "population acceptance priors); 0 measures a cold start "
                             "(default 1)")
    parser.add_argument("--speculative-allocation", choices=("host", "device"), default="host",
                        help="adaptive modes: host-allocated programs only (default), or also "
                             "ragged device-allocated ones (as flare run's flag)")
    parser.add_argument("--mtp-adaptive-verification-alpha", type=float, default=None,
                        help="adaptive modes: exponent on prefix-survival estimates (as flare "
                             "run's flag; default 1)")
    parser.add_argument("--seed-adaptive", action="store_true",
                        help="also run adaptive without counterfactual rounds, per source "
                             "(the seed's ACC-9 only; label '<source>:adaptive<=dN,acc9')")
    parser.add_argument("--draft-catch-up", type=int, default=DEFAULT_DRAFT_CATCH_UP,
                        help="learned modes: most missed positions a round re-feeds a "
                             "lagging draft (as flare run's flag; default "
                             f"{DEFAULT_DRAFT_CATCH_UP}: the draft runs on every decode)")
    parser.add_argument("--lagging-adaptive", type=int, default=0, metavar="K",
                        help="also run learned adaptive with a lagging draft context "
                             "(--draft-catch-up K; label 'draft:adaptive<=dN,lag<=K')")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--scheduler-policy", choices=("balanced", "throughput"),
                        default="balanced",
                        help="the seed's policy preset for every mode (default balanced, as "
                             "flare run; throughput values tokens only: no delivery or "
                             "output-age preference)")
    parser.add_argument("--adaptive-policies", type=_presets, default=(),
                        help="comma-separated presets: run each adaptive mode once under "
                             "each (label suffix ',<preset>'); default: once, under "
                             "--scheduler-policy")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every mode this many times, interleaved, and report the "
                             "median of each cell (a shared machine is noisy; default 1)")
    parser.add_argument("--diagnose", action="store_true",
                        help="also print host-side figures per mode and load: empty-window "
                             "launches, plan() cost per frame, device-busy share, programs run")
    parser.add_argument("--mixed-prefill", action="store_true",
                        help="every mode also loads mixed prefill/decode programs (as flare "
                             "run's flag): prompt chunks ride beside decode rows, with "
                             "speculative rows in speculative modes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    from ops.bench_speculation_sim import add_simulation_arguments

    add_simulation_arguments(parser)


def _presets(text: str) -> tuple[str, ...]:
    """``--adaptive-policies``: known preset names, comma-separated."""
    from policy.config import POLICY_PRESETS

    names = tuple(dict.fromkeys(n for n in text.split(",") if n))
    unknown = [n for n in names if n not in POLICY_PRESETS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown preset {', '.join(unknown)}; expected {', '.join(sorted(POLICY_PRESETS))}")
    return names


def _tiny(seed: int, hidden: int, layers: int) -> TinyLlama:
    return TinyLlama(shape=LlamaShape(
        vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256), seed=seed, init_std=0.3)


TINY_TARGET = _tiny(11, 32, 2)
TINY_DRAFT = _tiny(12, 16, 1)
"""A random tiny Llama target and a smaller draft sharing its word-level vocabulary."""


def modes_of(args: argparse.Namespace) -> list[Mode]:
    depths = [int(d) for d in args.depths.split(",") if d]
    modes = [Mode("off", "-", 0)]
    presets: list[str | None] = list(getattr(args, "adaptive_policies", ())) or [None]
    for source in (s for s in args.sources.split(",") if s):
        modes += [Mode("fixed", source, d) for d in depths]
        modes += [Mode("adaptive", source, max(depths), policy=p) for p in presets]
        if getattr(args, "seed_adaptive", False):
            modes.append(Mode("adaptive", source, max(depths), counterfactuals=False))
        if source == "draft" and getattr(args, "lagging_adaptive", 0) > 0:
            modes.append(Mode("adaptive", source, max(depths),
                              catch_up=args.lagging_adaptive))
    return modes


def prompts(rt: Runtime, count: int, length: int,
            modules: tuple[str, ...] = PROMPT_MODULES) -> list[tuple[int, ...]]:
    """Fixed prompts: the first ``length`` tokens of stdlib module docstrings."""
    import importlib

    result: list[tuple[int, ...]] = []
    for i in range(count):
        text = importlib.import_module(modules[i % len(modules)]).__doc__ or ""
        ids = rt.codec.encode(" ".join(text.split()))
        if len(ids) < length:  # word-level toy tokenizers map prose to <unk>: use ids
            ids = [3 + (i * 31 + j * 7) % (rt.codec.vocab_size - 3) for j in range(length)]
        result.append(tuple(ids[:length]))
    return result


async def run_load(rt: Runtime, streams: int, args: argparse.Namespace,
                   max_tokens: int, *, per_stream: int = 1,
                   modules: tuple[str, ...] = PROMPT_MODULES) -> Row:
    """``streams`` concurrent streams, each sending ``per_stream`` requests in turn
    (request ``k`` of stream ``i`` uses prompt ``k * streams + i``)."""
    produced = 0
    itls: list[float] = []
    gaps: list[float] = []
    every = prompts(rt, streams * per_stream, args.prompt_tokens, modules)

    async def stream(i: int) -> None:
        for k in range(per_stream):
            await one(every[k * streams + i])

    async def one(prompt: tuple[int, ...]) -> None:
        nonlocal produced
        request = GenerationRequest(prompt_token_ids=prompt, max_tokens=max_tokens,
                                    sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        first: float | None = None
        last = 0.0
        count = bursts = 0
        async with rt.generate(request) as events:
            async for event in events:
                if isinstance(event, TokenDelta) and event.token_ids:
                    now = trio.current_time()
                    if first is None:
                        first, count = now, len(event.token_ids) - 1
                    else:
                        count += len(event.token_ids)
                        bursts += 1
                    last = now
                elif isinstance(event, Finished):
                    produced += event.completion_tokens
        if first is not None and count > 0:
            itls.append((last - first) / count)
        if first is not None and bursts > 0:
            gaps.append((last - first) / bursts)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(stream, i)
    elapsed = trio.current_time() - start
    return Row(mode="", streams=streams, tokens=produced, seconds=elapsed,
               tokens_per_s=produced / elapsed if elapsed > 0 else 0.0,
               mean_itl_ms=1e3 * sum(itls) / len(itls) if itls else 0.0,
               mean_gap_ms=1e3 * sum(gaps) / len(gaps) if gaps else 0.0)


WARMUP_PASSES = 6
"""At most this many warm-up loads before a measured load."""


async def warm_up(rt: Runtime, streams: int, args: argparse.Namespace) -> int:
    """Short loads (8 tokens per stream) at the measured concurrency until one of them
    measures no program that was unknown before it (at most ``WARMUP_PASSES``); returns
    the passes run. Shape discovery (DUR-22, DUR-25: every unknown program runs once,
    alone) is a one-time cost a server pays at startup; adaptive mode has one program
    per batch bucket and width to discover where "off" has one per bucket, so a single
    short warm-up left adaptive discovering inside the measured load."""
    known = -1
    for passes in range(1, WARMUP_PASSES + 1):
        await run_load(rt, streams, args, max_tokens=8, modules=WARM_UP_MODULES)
        measured = len(rt.scheduler.estimates.measured())
        if measured == known:
            return passes
        known = measured
    return WARMUP_PASSES


def runtime_config(mode: Mode, args: argparse.Namespace, target: Path,
                   draft: Path) -> RuntimeConfig:
    """The runtime one mode runs on: the same model, catalog flags and policy for every
    mode; the allocation and alpha options apply to adaptive modes only."""
    loads = [int(n) for n in args.loads.split(",") if n]
    adaptive = mode.speculation == "adaptive"
    return RuntimeConfig(
        model_dir=target, **engine_config(args), max_batch=args.max_batch,
        mixed_prefill=getattr(args, "mixed_prefill", False),
        prefill_capacities=(64,), max_queue=max(max(loads), 1),
        scheduler_policy=mode.policy or args.scheduler_policy,  # type: ignore[arg-type]
        speculation=mode.speculation,  # type: ignore[arg-type]
        draft_source="draft" if mode.source == "-" else mode.source,  # type: ignore[arg-type]
        draft_model_dir=draft if mode.source == "draft" else None,
        copy_counterfactuals=mode.counterfactuals,
        draft_counterfactuals=mode.counterfactuals,
        draft_catch_up=mode.catch_up if mode.catch_up is not None else getattr(
            args, "draft_catch_up", DEFAULT_DRAFT_CATCH_UP),
        adaptive_verification_alpha=(getattr(args, "mtp_adaptive_verification_alpha", None)
                                     if adaptive else None),
        speculative_allocation=(getattr(args, "speculative_allocation", "host")  # type: ignore[arg-type]
                                if adaptive else "host"),
        **({"draft_depth": mode.depth} if mode.speculation != "off" else {}))


async def bench_mode(mode: Mode, args: argparse.Namespace, target: Path,
                     draft: Path) -> list[Row]:
    loads = [int(n) for n in args.loads.split(",") if n]
    config = runtime_config(mode, args, target, draft)
    rows: list[Row] = []
    async with open_runtime(config) as rt:
        timer = PlanTimer.install(rt) if getattr(args, "diagnose", False) else None
        for streams in loads:
            await warm_up(rt, streams, args)
            for _ in range(getattr(args, "warm_up_requests", 0)):
                await run_load(rt, streams, args, max_tokens=args.max_tokens,
                               modules=WARM_UP_MODULES)
            before = rt.statistics()
            if timer is not None:
                timer.reset()
            row = await run_load(rt, streams, args, max_tokens=args.max_tokens,
                                 per_stream=getattr(args, "requests_per_stream", 1))
            after = rt.statistics()
            drafted = after.speculative_drafted_tokens - before.speculative_drafted_tokens
            accepted = after.speculative_accepted_tokens - before.speculative_accepted_tokens
            runs = (sum(n for _, n in after.executions_by_kind)
                    - sum(n for _, n in before.executions_by_kind))
            speculative = after.speculative_frames - before.speculative_frames
            rows.append(Row(mode.label(), row.streams, row.tokens, row.seconds,
                            row.tokens_per_s, row.mean_itl_ms, mean_gap_ms=row.mean_gap_ms,
                            acceptance=accepted / drafted if drafted else 0.0,
                            speculative_share=speculative / runs if runs else 0.0,
                            diagnosis=diagnose(rt, before, after, row, timer)
                            if timer is not None else ""))
    return rows


class PlanTimer:
    """Wall and thread-CPU time of every ``plan()`` call (``--diagnose``)."""

    def __init__(self, plan: Callable[[], object]) -> None:
        self._plan = plan
        self.wall_ns: list[int] = []
        self.cpu_ns: list[int] = []

    @classmethod
    def install(cls, rt: Runtime) -> PlanTimer:
        scheduler = rt.scheduler
        timer = cls(scheduler.plan)
        scheduler.plan = timer  # type: ignore[method-assign, assignment]
        return timer

    def reset(self) -> None:
        self.wall_ns.clear()
        self.cpu_ns.clear()

    def __call__(self) -> object:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return self._plan()
        finally:
            self.cpu_ns.append(time.thread_time_ns() - cpu)
            self.wall_ns.append(time.perf_counter_ns() - wall)


def diagnose(rt: Runtime, before: RuntimeStatistics, after: RuntimeStatistics, row: Row,
             timer: PlanTimer) -> str:
    """One load's host-side figures (see the module docstring)."""
    ran = dict(after.executions_by_graph)
    for graph, count in before.executions_by_graph:
        ran[graph] -= count
    frames_run = sum(n for n in ran.values())
    frames = list(rt.frame_log())[-frames_run:] if frames_run else []
    gaps = [b.launched_ns - a.observed_ns for a, b in itertools.pairwise(frames)]
    empty = [g for g in gaps if g >= 0]
    span = frames[-1].observed_ns - frames[0].launched_ns if frames else 0
    busy = sum(f.device_ns for f in frames)
    calls = len(timer.wall_ns)
    device_ms: dict[str, list[float]] = {}
    for f in frames:
        device_ms.setdefault(f.graph, []).append(f.device_ns / 1e6)
    # the scheduler's duration estimate at the end of the load, beside what the program
    # took during it: on a machine whose speed drifts the two part ways
    estimates = {shape.label(): ns / 1e6
                 for shape, ns in rt.scheduler.estimates.measured().items()}

    def program(g: str, n: int) -> str:
        if g not in device_ms:
            return f"{n} {g}"
        est = f", est {estimates[g]:.1f}" if g in estimates else ""
        return f"{n} {g} ({statistics.median(device_ms[g]):.1f} ms{est})"

    mix = ", ".join(program(g, n) for g, n in sorted(ran.items(), key=lambda x: -x[1]) if n)
    return (f"frames {frames_run}, {row.tokens / max(frames_run, 1):.2f} tok/frame; "
            f"window empty at {len(empty)}/{len(gaps)} launches (mean gap "
            f"{statistics.fmean(empty) / 1e6 if empty else 0.0:.2f} ms); device busy "
            f"{busy / span if span else 0.0:.0%}; plan() {calls / max(frames_run, 1):.2f}/frame, "
            f"{statistics.fmean(timer.wall_ns) / 1e6 if calls else 0.0:.2f} ms wall, "
            f"{statistics.fmean(timer.cpu_ns) / 1e6 if calls else 0.0:.2f} ms cpu per call\n"
            f"      programs: {mix}")


def main(args: argparse.Namespace) -> int:
    import torch

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    if args.backend == "cpu":
        torch.set_num_threads(args.threads)
    if getattr(args, "simulate", None) is not None:
        from ops.bench_speculation_sim import SimulationInputError, simulated_rows

        try:
            rows = simulated_rows(args)
        except SimulationInputError as exc:
            print(f"flare bench speculation: {exc}", file=sys.stderr)
            return 2
    else:
        rows = measured_rows(args)
    summary = median_rows(rows)
    if args.json:
        print(json.dumps([asdict(r) for r in summary], sort_keys=True))
    else:
        print(render(summary))
        held_out = held_out_verdicts(rows)
        if held_out:
            print("\nbest fixed choice picked on held-out repeats "
                  "(ops/bench_verdicts.py):", *held_out, sep="\n")
        if getattr(args, "diagnose", False):
            print()
            for r in rows:
                print(f"{r.mode} @ {r.streams}: {r.tokens_per_s:.1f} tok/s\n    {r.diagnosis}")
    return 0


def measured_rows(args: argparse.Namespace) -> list[Row]:
    """Every mode and load on the real runtime, ``--repeats`` times interleaved."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = (write_tiny_pair(TINY_TARGET, TINY_DRAFT, Path(tmp)) if args.tiny
                         else (args.model, args.draft_model))
        for repeat in range(max(args.repeats, 1)):
            for mode in modes_of(args):
                rows += [replace(r, repeat=repeat)
                         for r in trio.run(bench_mode, mode, args, target, draft)]
    return rows
