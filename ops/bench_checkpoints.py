"""``flare bench checkpoints``: what terminal capture frames cost a client.

Runs the same workloads through ``open_runtime`` with ``state_operations`` off (the
terminal checkpoint is the host-side tail move) and on (every normal completion the
checkpoint allowance pays for ends with a SNAPSHOT frame), and prints per mode:

- **finish lag**: from a response's last ``TokenDelta`` to its ``Finished`` event, as
  the client sees it (p50 / p90 / max), sequential and concurrent;
- **continuation**: a next chat turn (prompt = previous prompt + answer + new message)
  sent the moment ``Finished`` arrives: its cached prompt tokens and its time to the
  first token (PRE-53: it must see the previous turn's checkpoint);
- **throughput**: wall time and generated tokens per second of the concurrent burst,
  and how many state frames ran;
- **timeline** of each first turn's capture frame in the sequential run: last token
  -> launch (selection and window drain), launch -> completion (the copy), and
  ``Finished`` -> completion (negative: ``Finished`` waited for the capture).

``--tiny`` builds the tests' tiny random Llama (d=32, 2 layers) instead of loading the
embedded default model.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import trio

from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
from actors.public import Finished, GenerationRequest, SamplingParams, TokenDelta
from actors.system import Runtime, open_runtime
from ops.tiny_model import TinyLlama, write_tiny_llama
from ops.training.llama import LlamaShape

GREEDY = SamplingParams(temperature=0.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help="HF-format model directory (default: the embedded model)")
    parser.add_argument("--tiny", action="store_true",
                        help="build a tiny random Llama (d=32, 2 layers) in a temp dir")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--sequential", type=int, default=12,
                        help="requests one after another (each a two-turn conversation)")
    parser.add_argument("--concurrent", type=int, default=24,
                        help="requests arriving within --burst-s")
    parser.add_argument("--burst-s", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=1, help="repetitions per mode")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


TINY = TinyLlama(shape=LlamaShape(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512), seed=11,
    init_std=0.3)
"""The runtime tests' tiny random Llama (vocab 96, d=32, 2 layers)."""


@dataclass(slots=True)
class _Outcome:
    tokens: list[int] = field(default_factory=list)
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    finished_s: float = 0.0
    cached: int = 0


async def _generate(rt: Runtime, prompt: list[int], max_tokens: int) -> _Outcome:
    out = _Outcome()
    start = trio.current_time()
    request = GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=max_tokens,
                                sampling=GREEDY, ignore_eos=True)
    async with rt.generate(request) as events:
        async for event in events:
            now = trio.current_time()
            if isinstance(event, TokenDelta):
                if not out.tokens:
                    out.first_token_s = now - start
                out.tokens.extend(event.token_ids)
                out.last_token_s = now
            elif isinstance(event, Finished):
                out.finished_s = now
                out.cached = event.cached_prompt_tokens
    return out


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": 0.0, "p90": 0.0, "max": 0.0}
    return {"p50": round(statistics.median(ordered) * 1e3, 2),
            "p90": round(ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)] * 1e3, 2),
            "max": round(ordered[-1] * 1e3, 2)}


def _state_frames(rt: Runtime) -> int:
    return sum(n for graph, n in rt.statistics().executions_by_graph
               if graph.startswith("state"))


async def _run_mode(model_dir: Path, args: argparse.Namespace, state_operations: bool,
                    seed: int) -> dict[str, object]:
    config = RuntimeConfig(model_dir=model_dir, backend="cpu", max_batch=args.max_batch,
                           prefill_capacities=(64,), page_size=16, max_context=512,
                           state_operations=state_operations, max_queue=256)
    rng = random.Random(seed)
    async with open_runtime(config) as rt:
        vocab = rt.codec.vocab_size
        # Warm-up: every prefill and decode shape runs at least once.
        async with trio.open_nursery() as nursery:
            for _ in range(args.max_batch):
                nursery.start_soon(_generate, rt, _prompt(rng, vocab, 20), 4)
        lags: list[float] = []
        timeline: list[tuple[float, float, float]] = []
        continuation_ttft: list[float] = []
        continuation_cached: list[int] = []
        for _ in range(args.sequential):
            prompt = _prompt(rng, vocab, rng.randrange(20, 61))
            first = await _generate(rt, prompt, args.max_tokens)
            lags.append(first.finished_s - first.last_token_s)
            turn_two = [*prompt, *first.tokens, *_prompt(rng, vocab, 6)]
            second = await _generate(rt, turn_two, 2)
            continuation_ttft.append(second.first_token_s)
            continuation_cached.append(second.cached)
            # Turn one's capture: the first state frame launched after its last token.
            last_ns = first.last_token_s * 1e9
            capture = next((f for f in rt.frame_log() if f.graph.startswith("state")
                            and f.launched_ns >= last_ns), None)
            if capture is not None:
                launched, observed = capture.launched_ns / 1e9, capture.observed_ns / 1e9
                timeline.append((launched - first.last_token_s, observed - launched,
                                 observed - first.finished_s))
        before_states = _state_frames(rt)
        concurrent: list[_Outcome] = []

        async def one(prompt: list[int]) -> None:
            concurrent.append(await _generate(rt, prompt, args.max_tokens))

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrent):
                nursery.start_soon(one, _prompt(rng, vocab, rng.randrange(8, 41)))
                await trio.sleep(args.burst_s / max(args.concurrent, 1))
        wall = trio.current_time() - start
        generated = sum(len(o.tokens) for o in concurrent)
        return {
            "state_operations": state_operations,
            "sequential_finish_lag_ms": _ms(lags),
            "concurrent_finish_lag_ms": _ms([o.finished_s - o.last_token_s
                                             for o in concurrent]),
            "continuation_ttft_ms": _ms(continuation_ttft),
            "continuation_cached_tokens_mean": round(statistics.fmean(continuation_cached), 1),
            "concurrent_wall_s": round(wall, 3),
            "concurrent_tokens_per_s": round(generated / wall, 1),
            "concurrent_state_frames": _state_frames(rt) - before_states,
            "snapshot_timeline_ms": {
                "last_token_to_launch": _ms([t[0] for t in timeline]),
                "copy": _ms([t[1] for t in timeline]),
                "finished_to_completion": _ms([t[2] for t in timeline]),
            } if timeline else None,
        }


async def bench(args: argparse.Namespace, model_dir: Path) -> list[dict[str, object]]:
    rows = []
    for run in range(args.runs):
        for state_operations in (False, True):
            rows.append(await _run_mode(model_dir, args, state_operations, seed=run))
    return rows


def main(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_llama(TINY, Path(tmp)) if args.tiny else args.model
        rows = trio.run(bench, args, model_dir)
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        print(json.dumps(row, indent=1))
    return 0
