"""``flare bench forward``: each prepared step program beside the same forward in
plain torch.

The plain forward is what a user would write with no serving machinery: the same
weights (the engine's decoder tensors), a contiguous KV cache tensor per layer
``[B, kv_heads, context, head_dim]`` (no paging, no packing), SDPA attention
(``torch.nn.functional.scaled_dot_product_attention``, causal for a prefill chunk
from position 0) and a greedy argmax over the last token's logits. Each program runs
its full-capacity benchmark frame (``ops.bench_programs.benchmark_frame``: every lane
active, ``--context`` cached tokens per decode lane); the program's ``bind`` runs
outside the timed interval and ``execute`` is timed on this thread, as the cpu
backend's worker runs it. The two are timed round-robin, shape by shape, in one
process, so load from other processes hits both alike; per shape it prints the
medians, min/max, the ratio and, with ``--profile``, the program's top operators
(``torch.profiler``, self CPU time). Llama-family models without sliding windows,
q/k norms or soft caps only (the plain forward is the textbook one). The process's C
allocator keeps freed memory, as in the cpu backend (``gpu.backends.host_allocator``;
``--allocator-defaults`` keeps glibc's defaults).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.config import DEFAULT_MODEL_DIR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=pathlib.Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="decode batch sizes to time")
    parser.add_argument("--prefill-capacity", type=int, nargs="+", default=[64, 256],
                        dest="prefill_capacities", help="prefill chunk capacities (x64)")
    parser.add_argument("--context", type=int, default=128,
                        help="tokens already cached in each decode lane")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="torch intra-op thread counts, alternated within each round")
    parser.add_argument("--no-capture", action="store_true",
                        help="run the eager forward instead of the captured one (which "
                             "flare run replays)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time with the wall clock, or with this thread's CPU time "
                             "(steadier on a machine other processes load)")
    parser.add_argument("--allocator-defaults", action="store_true",
                        help="keep the C allocator's default settings instead of the "
                             "ones the cpu backend sets (gpu.backends.host_allocator)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the top operators of each program")


class PlainForward:
    """The textbook Llama forward over contiguous per-layer KV tensors."""

    def __init__(self, decoder: Any, batch: int, max_context: int) -> None:
        import torch

        cfg = decoder.config
        self.d, self.cfg = decoder, cfg
        shape = (batch, cfg.num_kv_heads, max_context, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=decoder.dtype) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=decoder.dtype) for _ in range(cfg.num_layers)]

    def step(self, tokens: Any, start: int) -> Any:
        """Greedy next tokens of ``tokens`` ``[B, T]`` at positions ``start..``."""
        import torch
        import torch.nn.functional as F

        d, cfg = self.d, self.cfg
        b, t = tokens.shape
        h_heads, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = d.rope_cos[start:start + t][None, None]
        sin = d.rope_sin[start:start + t][None, None]
        h = d.embed[tokens]
        end = start + t

        def norm(x: Any, w: Any) -> Any:
            return F.rms_norm(x, (x.shape[-1],), w, cfg.rms_norm_eps)

        def rope(x: Any) -> Any:
            half = hd // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        for i in range(cfg.num_layers):
            layer = f"model.layers.{i}."
            x = norm(h, d.w[layer + "input_layernorm.weight"])
            qkv = F.linear(x, d.qkv_weight[i], d.qkv_bias[i]).view(b, t, h_heads + 2 * kvh, hd)
            q, k, v = qkv.transpose(1, 2).split((h_heads, kvh, kvh), dim=1)
            self.keys[i][:, :, start:end] = rope(k)
            self.values[i][:, :, start:end] = v
            attn = F.scaled_dot_product_attention(
                rope(q), self.keys[i][:, :, :end], self.values[i][:, :, :end],
                is_causal=t > 1 and start == 0, enable_gqa=True)
            h = h + F.linear(attn.transpose(1, 2).reshape(b, t, h_heads * hd),
                             d.w[layer + "self_attn.o_proj.weight"])
            x = norm(h, d.w[layer + "post_attention_layernorm.weight"])
            gate, up = F.linear(x, d.gate_up_weight[i]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, d.w[layer + "mlp.down_proj.weight"])
        last = norm(h[:, -1], d.w["model.norm.weight"])
        return F.linear(last, d.lm_head).argmax(-1)


def _stats(samples: list[float]) -> tuple[float, float, float]:
    return statistics.median(samples), min(samples), max(samples)


def _top_ops(program: Any, frame: Any, count: int = 6, runs: int = 5) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            program.bind(frame)
            program.execute()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return ", ".join(f"{e.key} {100 * e.self_cpu_time_total / total:.0f}%"
                     for e in events[:count])


@dataclass(frozen=True, slots=True)
class Pair:
    """One program shape and the plain forward of the same work."""

    shape: Any
    program: Any
    frame: dict[str, Any]
    plain: PlainForward
    tokens: Any
    """The plain forward's input ``[B, T]`` (the frame's tokens)."""
    start: int


def load_pairs(model: pathlib.Path, *, batches: Sequence[int], capacities: Sequence[int],
               context: int, max_context: int, page_size: int, capture: bool) -> list[Pair]:
    """The embedded engine's decode and prefill programs with their plain forwards."""
    import torch

    from gpu.catalog import CatalogFlags, ModelDims, plan_catalog
    from gpu.engine import ModelEngine
    from gpu.frames import as_inputs
    from gpu.model.config import load_model_config
    from gpu.programs.execution import ExecutionOptions
    from ops.bench_programs import Layout, benchmark_frame
    from policy.descriptors import GraphKind

    config = load_model_config(model)
    max_batch = max(batches)
    flags = CatalogFlags(max_batch=max_batch, prefill_capacities=tuple(capacities),
                         mixed_prefill=False, family_supports_mixed=config.mixed_capture)
    dims = ModelDims(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     vocab_size=config.vocab_size, num_attention_heads=config.num_heads,
                     num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
                     dtype_bytes=4)
    plan = plan_catalog(flags, dims)
    layout = Layout(page_size=page_size, max_context=max_context, max_batch=max_batch,
                    context=context)
    engine = ModelEngine.load(
        model, device="cpu", dtype=torch.float32, catalog=plan.catalog.shapes,
        page_size=layout.page_size, num_pages=layout.num_pages, state_rows=layout.state_rows,
        max_context=max_context, require_tokenizer=False,
        execution=ExecutionOptions.eager(capture_forward=capture))
    pairs = []
    for shape in plan.catalog:
        frame, _ = benchmark_frame(shape, layout, config.vocab_size)
        if shape.kind is GraphKind.DECODE and shape.batch_capacity in batches:
            # every lane's pending token is 5 (``benchmark_frame``'s reset)
            tokens, start = torch.full((shape.batch_capacity, 1), 5), context
        elif shape.kind is GraphKind.PREFILL:
            tokens, start = torch.tensor([frame.tokens]), 0
        else:
            continue
        pairs.append(Pair(shape, engine.programs[shape], as_inputs(frame),
                          PlainForward(engine.parts.decoder, tokens.shape[0], max_context),
                          tokens, start))
    return pairs


def main(args: argparse.Namespace) -> int:
    import torch

    if not (args.model / "config.json").is_file():
        print(f"flare bench forward: no checkpoint in {args.model}", file=sys.stderr)
        return 2
    from gpu.model.config import load_model_config

    cfg = load_model_config(args.model)
    if (cfg.qk_norm or cfg.gemma_norms or cfg.attention_softcap is not None
            or cfg.attention_scale is not None or cfg.hidden_act != "silu"
            or any(w is not None for w in cfg.layer_windows)):
        print("flare bench forward: the plain forward is Llama's (no q/k norms, Gemma "
              "norms, soft caps, scales, sliding windows or non-SiLU MLP)", file=sys.stderr)
        return 2
    from gpu.backends.host_allocator import keep_freed_memory

    if not args.allocator_defaults:
        keep_freed_memory()  # as the cpu backend and its device process run programs
    jobs = [(p.shape, p.program, p.frame, p.plain, p.tokens, p.start) for p in load_pairs(
        args.model, batches=args.batches, capacities=args.prefill_capacities,
        context=args.context, max_context=args.max_context, page_size=args.page_size,
        capture=not args.no_capture)]
    threads = tuple(args.threads)
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    flare_ms: dict[tuple[int, int], list[float]] = {}
    plain_ms: dict[tuple[int, int], list[float]] = {}
    with torch.inference_mode():
        for i in range(args.warmup + args.repeats):
            for n in threads:
                torch.set_num_threads(n)
                for j, (_, program, frame, plain, tokens, start) in enumerate(jobs):
                    program.bind(frame)
                    t0 = clock()
                    program.execute()
                    t1 = clock()
                    plain.step(tokens, start)
                    t2 = clock()
                    if i >= args.warmup:
                        flare_ms.setdefault((n, j), []).append((t1 - t0) / 1e6)
                        plain_ms.setdefault((n, j), []).append((t2 - t1) / 1e6)
        print(f"context {args.context}, {'eager' if args.no_capture else 'captured'} "
              f"forward, {args.clock} clock, median (min-max) ms of {args.repeats} "
              "alternated runs")
        print(f"{'threads':>7} {'shape':<16} {'flare ms':>20} {'plain ms':>20} "
              f"{'flare/plain':>11} {'flare tok/s':>11}")
        for n in threads:
            torch.set_num_threads(n)
            for j, (shape, program, frame, _, tokens, _) in enumerate(jobs):
                fm, fmin, fmax = _stats(flare_ms[n, j])
                pm, pmin, pmax = _stats(plain_ms[n, j])
                print(f"{n:>7} {shape.label():<16} {fm:>8.2f} ({fmin:.2f}-{fmax:.2f}) "
                      f"{pm:>8.2f} ({pmin:.2f}-{pmax:.2f}) {fm / pm:>11.2f} "
                      f"{tokens.numel() / fm * 1000:>11.0f}")
                if args.profile:
                    print(f"        top ops: {_top_ops(program, frame)}", flush=True)
    return 0
