"""``flare bench runtime``: does the two-slot window hide planning and publication?

Runs a saturating, decode-heavy load (by default 16 requests of 32 prompt and 256
output tokens on 8 request slots) through the whole runtime (``open_runtime``: the
six actors, the real scheduler, the real model on the chosen backend) and prints, over
the measured window, the device-busy fraction (sum of program execution intervals /
wall time) and the host gap between consecutive frames (the time from observing one
frame's completion to launching the next; zero when the next was already queued),
p50 and p99. The target is a busy fraction of at least 0.95.

On the CPU backend it also prints the stream worker thread's CPU time over the wall
of the measured load: the share of the wall the "device" actually computed. The
execution interval also counts time the worker spends waiting for the GIL while the
trio actors run Python (every torch op releases it), so the busy fraction minus the
worker-CPU share is host Python the window did not hide (see docs/runtime.md).

It then times the same programs alone (``flare bench programs`` in a fresh process,
same batch limit, capacities, forward execution and the load's mean decode context) and
prints, per graph the load ran, the in-server mean interval over the isolated median:
host work that slows the "device" shows there instead of hiding inside the interval.
With ``--requests 1`` it also prints the stream's output tokens/s over the isolated
``decode[B=1]`` rate (one token per interval alone).

With ``--tiny`` it builds a random tiny Llama (``ops.tiny_model``) in a temporary
directory (no download), so the benchmark runs on a fresh machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import structlog
import trio

from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
from actors.planner_records import FrameRecord
from actors.public import Finished, GenerationRequest, SamplingParams
from actors.system import Runtime, open_runtime
from gpu.backends.rank_programs import held_bytes
from ops.engine_flags import add_engine_flags, engine_config
from ops.process_memory import DEVICE_PROCESS_PREFIX, serving_memory
from ops.tiny_model import TinyLlama, write_tiny_llama
from ops.training.llama import LlamaShape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help="HF-format model directory (default: the embedded model)")
    parser.add_argument("--tiny", action="store_true",
                        help="build a random tiny Llama (d=256, 4 layers) in a temp dir")
    parser.add_argument("--tiny-hidden", type=int, default=256, metavar="D",
                        help="with --tiny: its hidden size (a multiple of 64; heads of 32, "
                             "half as many KV heads, MLP 11/4 D), e.g. 1536 for a model of "
                             "112 M parameters whose memory is plain to see")
    add_engine_flags(parser)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16,
                        help="concurrent requests (keep above --max-batch to saturate)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="output tokens per request (default 256: decode-heavy, eight "
                             "output tokens per prompt token; every prompt's prefill drains "
                             "the window, QUEUE-12)")
    parser.add_argument("--cost-drift-weight", type=float, default=None,
                        help="flare run's flag of that name (default: the backend's)")
    parser.add_argument("--mixed-prefill", action="store_true",
                        help="prepare mixed programs, as flare run does for a load without "
                             "speculation")
    parser.add_argument("--no-isolated", action="store_true",
                        help="skip timing the load's programs alone (flare bench programs) "
                             "for the in-server / isolated interval ratio")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def tiny(hidden: int = 256) -> TinyLlama:
    """A random Llama (``hidden`` wide, 4 layers, vocab 4096) with a word-level
    tokenizer."""
    if hidden < 64 or hidden % 64:
        raise SystemExit(f"--tiny-hidden must be a positive multiple of 64, got {hidden}")
    return TinyLlama(shape=LlamaShape(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=4, num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64, max_position_embeddings=1024), seed=0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def graph_counts(frames: list[FrameRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for frame in frames:
        counts[frame.graph] = counts.get(frame.graph, 0) + 1
    return dict(sorted(counts.items()))


def summarize(frames: list[FrameRecord]) -> dict[str, float]:
    """Busy fraction and host gaps over consecutive completed frames."""
    if len(frames) < 2:
        return {"frames": float(len(frames)), "busy_fraction": 0.0,
                "gap_p50_ms": 0.0, "gap_p99_ms": 0.0, "wall_ms": 0.0}
    wall = frames[-1].observed_ns - frames[0].launched_ns
    busy = sum(f.device_ns for f in frames) / wall if wall > 0 else 0.0
    gaps = [max(b.launched_ns - a.observed_ns, 0) / 1e6 for a, b in itertools.pairwise(frames)]
    return {
        "frames": float(len(frames)), "wall_ms": wall / 1e6, "busy_fraction": busy,
        "gap_p50_ms": statistics.median(gaps), "gap_p99_ms": percentile(gaps, 0.99),
        "queued_fraction": sum(1 for g in gaps if g == 0) / len(gaps),
    }


PREFILL_CAPACITIES = (64, 256)

CPU_STREAM_PREFIX = "flare-cpu-stream-"
"""Name prefix of the CPU backend's worker threads (``CpuBackend.stream_name``)."""


def cpu_worker_ns() -> int | None:
    """Total CPU time of the live CPU-backend worker threads (None: no such thread)."""
    total, found = 0, False
    for thread in threading.enumerate():
        if thread.name.startswith(CPU_STREAM_PREFIX) and thread.ident is not None:
            try:
                clock = time.pthread_getcpuclockid(thread.ident)
                total += time.clock_gettime_ns(clock)
                found = True
            except (OSError, AttributeError):
                continue
    return total if found else None


def device_process_ns() -> int | None:
    """Total CPU time of the live CPU device processes (None: no such process)."""
    import multiprocessing
    import os

    total, found = 0, False
    ticks = os.sysconf("SC_CLK_TCK")
    for child in multiprocessing.active_children():
        if child.name.startswith(DEVICE_PROCESS_PREFIX) and child.pid is not None:
            try:
                fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) * 1_000_000_000 // ticks
            found = True
    return total if found else None


async def _load(rt: Runtime, *, requests: int, prompt_tokens: int, max_tokens: int,
                vocab: int) -> int:
    produced = 0

    async def one(i: int) -> None:
        nonlocal produced
        prompt = tuple(3 + (i * 7919 + j * 104729) % (vocab - 3) for j in range(prompt_tokens))
        request = GenerationRequest(prompt_token_ids=prompt, max_tokens=max_tokens,
                                    sampling=SamplingParams(temperature=0.0),
                                    ignore_eos=True)
        async with rt.generate(request) as events:
            async for event in events:
                if isinstance(event, Finished):
                    produced += event.completion_tokens

    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(one, i)
    return produced


async def bench(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    config = RuntimeConfig(model_dir=model_dir, **engine_config(args),
                           max_batch=args.max_batch, prefill_capacities=PREFILL_CAPACITIES,
                           max_queue=max(args.requests, args.max_batch, 1),
                           cost_drift_weight=args.cost_drift_weight,
                           mixed_prefill=args.mixed_prefill)
    async with open_runtime(config) as rt:
        vocab = rt.codec.vocab_size
        # Warm-up: discover every shape the load will use (discovery drains the window).
        await _load(rt, requests=args.max_batch, prompt_tokens=args.prompt_tokens,
                    max_tokens=8, vocab=vocab)
        first_fence = len(rt.frame_log()) and rt.frame_log()[-1].fence
        start = trio.current_time()
        worker_start = cpu_worker_ns()
        device_start, host_start = device_process_ns(), time.process_time_ns()
        tokens = await _load(rt, requests=args.requests, prompt_tokens=args.prompt_tokens,
                             max_tokens=args.max_tokens, vocab=vocab)
        worker_end = cpu_worker_ns()
        device_end, host_end = device_process_ns(), time.process_time_ns()
        elapsed = trio.current_time() - start
        frames = [f for f in rt.frame_log() if f.fence > first_fence]
        memory = serving_memory()
        held = {"server": held_bytes(list(rt._parts.programs.values()))}
        devices = getattr(rt._parts.backend, "held_bytes", ())  # device processes only
        for i, device in enumerate(devices):
            held[f"device {i}"] = device
    result: dict[str, object] = dict(summarize(frames))
    result["tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
    if worker_start is not None and worker_end is not None and elapsed > 0:
        result["worker_cpu_fraction"] = (worker_end - worker_start) / 1e9 / elapsed
    if elapsed > 0:
        result["server_cpu_fraction"] = (host_end - host_start) / 1e9 / elapsed
    if device_start is not None and device_end is not None and elapsed > 0:
        result["device_process_cpu_fraction"] = (device_end - device_start) / 1e9 / elapsed
    result["memory"] = memory
    result["held_bytes"] = held
    result["graphs"] = graph_counts(frames)
    result["frame_records"] = frames
    result["mean_device_ms"] = (sum(f.device_ns for f in frames) / len(frames) / 1e6
                                if frames else 0.0)
    return result


def in_server_intervals(frames: list[FrameRecord]) -> dict[str, tuple[int, float]]:
    """Per graph: frames run and their mean device interval (ms) inside the server."""
    by_graph: dict[str, list[int]] = {}
    for frame in frames:
        by_graph.setdefault(frame.graph, []).append(frame.device_ns)
    return {graph: (len(ns), sum(ns) / len(ns) / 1e6) for graph, ns in sorted(by_graph.items())}


def isolated_intervals(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Median device interval (ms) of every program timed alone by ``flare bench
    programs`` in a fresh process, with the load's batch limit, prefill capacities, mean
    decode context and forward execution (captured unless ``--eager-forward``)."""
    context = args.prompt_tokens + args.max_tokens // 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "programs.json"
        command = [sys.executable, "-m", "ops.cli", "bench", "programs", "--model",
                   str(model_dir), "--backend", args.backend, "--max-batch",
                   str(args.max_batch), "--prefill-capacity", *map(str, PREFILL_CAPACITIES),
                   "--context", str(context), "--json", str(out),
                   "--tensor-parallel-size", str(args.tensor_parallel_size)]
        if not args.eager_forward and args.backend == "cpu" and args.tensor_parallel_size == 1:
            command.append("--capture-forward")  # ranks run their shards op by op
        subprocess.run(command, check=True, capture_output=True)
        results = json.loads(out.read_text())["results"]
    return {r["shape"]: float(r["median_device_ms"]) for r in results}


def interval_ratios(in_server: dict[str, tuple[int, float]], isolated: dict[str, float]
                    ) -> list[dict[str, object]]:
    """In-server mean over isolated median interval for every graph both timed, the most
    run first."""
    rows = [{"graph": graph, "frames": count, "in_server_ms": mean,
             "isolated_ms": isolated[graph], "ratio": mean / isolated[graph]}
            for graph, (count, mean) in in_server.items() if isolated.get(graph, 0) > 0]
    return sorted(rows, key=lambda r: -int(str(r["frames"])))


def single_stream_ratio(tokens_per_s: float, isolated: dict[str, float]) -> float | None:
    """One stream's output tokens/s over the rate of ``decode[B=1]`` timed alone (one
    token per isolated interval); None when that program was not timed."""
    alone_ms = isolated.get("decode[B=1]", 0.0)
    return tokens_per_s * alone_ms / 1000.0 if alone_ms > 0 else None


def main(args: argparse.Namespace) -> int:
    # The planner logs a debug trace record per frame; keep the benchmark's output clean.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_llama(tiny(args.tiny_hidden), Path(tmp)) if args.tiny else args.model
        result = trio.run(bench, args, model_dir)
        if not args.no_isolated:
            in_server = in_server_intervals(result.pop("frame_records"))  # type: ignore[arg-type]
            isolated = isolated_intervals(model_dir, args)
            result["interval_ratios"] = interval_ratios(in_server, isolated)
            if args.requests == 1:
                result["single_stream_ratio"] = single_stream_ratio(
                    float(result["tokens_per_s"]), isolated)  # type: ignore[arg-type]
        result.pop("frame_records", None)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"frames               {result['frames']:.0f}   ({result['graphs']})")
    print(f"wall                 {result['wall_ms']:.1f} ms")
    print(f"mean device interval {result['mean_device_ms']:.3f} ms")
    print(f"device-busy fraction {result['busy_fraction']:.3f}   (target >= 0.95)")
    print(f"host gap p50 / p99   {result['gap_p50_ms']:.3f} / {result['gap_p99_ms']:.3f} ms")
    print(f"frames queued behind another: {result.get('queued_fraction', 0.0):.1%}")
    print(f"output tokens/s      {result['tokens_per_s']:.1f}")
    for row in result.get("interval_ratios", []):  # type: ignore[attr-defined]
        print(f"{row['graph']:<20} in server {row['in_server_ms']:.3f} ms over "
              f"{row['frames']} frames, alone {row['isolated_ms']:.3f} ms: "
              f"ratio {row['ratio']:.2f}")
    if result.get("single_stream_ratio") is not None:
        print(f"single stream / isolated decode[B=1] rate {result['single_stream_ratio']:.2f}"
              "   (target >= 0.9)")
    print(f"server process CPU/wall {result['server_cpu_fraction']:.3f}")
    if "device_process_cpu_fraction" in result:
        print(f"device process CPU/wall {result['device_process_cpu_fraction']:.3f}   "
              "(share of the wall the device process computed, bind and read included; "
              "summed over the ranks under -tp)")
    print_memory(result)
    if "worker_cpu_fraction" in result:
        print(f"cpu worker CPU/wall  {result['worker_cpu_fraction']:.3f}   "
              "(share of the wall the worker computed, bind and read included)")
    return 0


def print_memory(result: dict[str, object]) -> None:
    """Each process's RSS and PSS, and what each device process's programs hold."""
    mib = 1 << 20
    for name, memory in result["memory"].items():  # type: ignore[attr-defined]
        print(f"{name + ' memory':<20} RSS {memory['rss'] / mib:.1f} MiB, "
              f"PSS {memory['pss'] / mib:.1f} MiB")
    for name, held in result["held_bytes"].items():  # type: ignore[attr-defined]
        print(f"{name + ' holds':<20} {held['weights'] / mib:.2f} MiB of parameters "
              f"(and {held['packed'] / mib:.2f} MiB of their packed copies), "
              f"{held['kv'] / mib:.2f} MiB of KV pool")
