"""``flare bench peer``: flare against another OpenAI-compatible server, side by side.

Starts ``flare run`` and a peer command (default: ``transformers serve
--continuous-batching`` on the same model directory; any command line with ``{port}`` and
``{model}`` placeholders works) on free loopback ports, keeps both up, and at each stream
count sends the same load to flare then to the peer, ``--pairs`` times (A B A B ...), so
drift on a shared machine hits both alike. Two loads: non-streaming greedy completions
(aggregate output tokens/s) and streaming (TTFT and ITL medians). Prints, per stream
count, both servers' median figures and the per-pair ratio flare / peer (min, median,
max), and writes every figure to ``<output-dir>/peer.json``. ``docs/benchmarks.md`` has
the current table and the command that made it.

Greedy outputs of the same model are the same on both servers, so both answer with the
same number of tokens unless one stops early; the table prints each side's mean answer
length so a difference is visible. ``--ignore-eos`` sends vLLM's ``ignore_eos`` to both
(a peer that refuses unknown fields then answers errors, which are counted). Before the
first pair each server answers one untimed load at the largest stream count (warm-up).
Every pair sends prompts new to both servers (one seed per pair, shared by its two
loads), so a server with a prefix cache gains nothing from an earlier load;
``--repeat-prompts`` sends every load the same prompts instead (a repeated-prompt load).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import shlex
import shutil
import statistics
import sys
from dataclasses import replace
from functools import partial
from typing import Any

import trio

from actors.config import DEFAULT_MODEL_DIR
from ops import launch
from ops.loadgen.prompts import load_prompt_builder
from ops.peer_loads import (
    LoadShape,
    closed_loop_completions,
    fixed_prompts,
    pair_ratios,
    streaming_load,
)

DEFAULT_PEER = ("transformers serve --continuous-batching --device cpu --dtype float32 "
                "--host 127.0.0.1 --port {port} {model}")
MODES = ("nonstream", "stream")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=pathlib.Path, default=DEFAULT_MODEL_DIR,
                        help="model directory both servers serve (default: the embedded model)")
    parser.add_argument("--peer-command", default=DEFAULT_PEER,
                        help="peer server command line; {port} and {model} are filled in "
                             "(default: %(default)s)")
    parser.add_argument("--flare-args", default="--log-level warning",
                        help="extra flare run flags (one string, default %(default)r)")
    parser.add_argument("--streams", default="1,8,16",
                        help="comma-separated concurrent stream counts (default %(default)s)")
    parser.add_argument("--pairs", type=int, default=5, help="A/B pairs per stream count")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="requests per stream in one load (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="which loads: nonstream, stream or both (default %(default)s)")
    parser.add_argument("--repeat-prompts", action="store_true",
                        help="send every load the same prompts (default: new prompts per pair)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos=true to both servers")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds one load may run (default %(default)s)")
    parser.add_argument("--output-dir", type=pathlib.Path, default=pathlib.Path("peer-results"))


def parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"--streams wants positive integers separated by commas, got {text!r}")
    return counts


def peer_command(template: str, *, port: int, model: pathlib.Path) -> list[str]:
    """The peer's argv; a program not on PATH is looked for beside this Python (a
    virtual environment's scripts, e.g. ``transformers``, without activating it)."""
    command = [part.format(port=port, model=model) for part in shlex.split(template)]
    beside = pathlib.Path(sys.executable).parent / command[0] if command else None
    if command and shutil.which(command[0]) is None and beside is not None and beside.exists():
        command[0] = str(beside)
    return command


def flare_command(extra: str, *, port: int, model: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "ops.cli", "run", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *shlex.split(extra)]


async def one_load(mode: str, base_url: str, builder: Any, shape: LoadShape,
                   timeout_s: float) -> dict[str, Any]:
    """One load's figures as a flat dict (``tokens_per_s`` always; stream adds latencies)."""
    if mode == "nonstream":
        result = await closed_loop_completions(base_url, fixed_prompts(builder, shape), shape,
                                               timeout_s=timeout_s)
        figures = result.to_json()
        figures["mean_answer_tokens"] = (result.completion_tokens / result.answered
                                         if result.answered else 0.0)
        return figures
    summary = await streaming_load(base_url, builder, shape, timeout_s=timeout_s)
    ok = summary["requests"]["ok"]
    return {"tokens_per_s": summary["throughput"]["output_tokens_per_s"],
            "ttft_p50_s": summary["ttft_s"].get("median"),
            "itl_p50_s": summary["itl_s"].get("median"), "answered": ok,
            "errors": summary["requests"]["error"]}


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else math.nan


def summarize_pairs(flare: list[dict[str, Any]], peer: list[dict[str, Any]]) -> dict[str, Any]:
    low, mid, high = pair_ratios([r["tokens_per_s"] for r in flare],
                                 [r["tokens_per_s"] for r in peer])
    out: dict[str, Any] = {"flare_tokens_per_s": _median(flare, "tokens_per_s"),
                           "peer_tokens_per_s": _median(peer, "tokens_per_s"),
                           "ratio_min": low, "ratio_median": mid, "ratio_max": high,
                           "flare_errors": sum(r["errors"] for r in flare),
                           "peer_errors": sum(r["errors"] for r in peer)}
    for key in ("ttft_p50_s", "itl_p50_s", "mean_answer_tokens"):
        if any(key in r for r in flare):
            out[f"flare_{key}"] = _median(flare, key)
            out[f"peer_{key}"] = _median(peer, key)
    return out


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.1f}"


def format_tables(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    lines: list[str] = []
    for mode, by_streams in results.items():
        lines.append(f"{mode}:")
        if mode == "nonstream":
            lines += ["| streams | flare tok/s | peer tok/s | flare / peer (min, median, max) "
                      "| answer tokens flare / peer | errors flare / peer |",
                      "|---|---|---|---|---|---|"]
        else:
            lines += ["| streams | flare tok/s | peer tok/s | flare / peer (min, median, max) "
                      "| TTFT p50 flare / peer (ms) | ITL p50 flare / peer (ms) "
                      "| errors flare / peer |", "|---|---|---|---|---|---|---|"]
        for streams, s in by_streams.items():
            ratio = f"{s['ratio_min']:.2f}, {s['ratio_median']:.2f}, {s['ratio_max']:.2f}"
            cells = [str(streams), f"{s['flare_tokens_per_s']:.0f}",
                     f"{s['peer_tokens_per_s']:.0f}", ratio]
            if mode == "nonstream":
                cells.append(f"{s['flare_mean_answer_tokens']:.1f} / "
                             f"{s['peer_mean_answer_tokens']:.1f}")
            else:
                cells += [f"{_ms(s['flare_ttft_p50_s'])} / {_ms(s['peer_ttft_p50_s'])}",
                          f"{_ms(s['flare_itl_p50_s'])} / {_ms(s['peer_itl_p50_s'])}"]
            cells.append(f"{s['flare_errors']} / {s['peer_errors']}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def run_pairs(args: argparse.Namespace, flare_url: str, peer_url: str,
              counts: tuple[int, ...], modes: tuple[str, ...]) -> dict[str, Any]:
    builder, note = load_prompt_builder(args.model)
    if note:
        print(f"flare bench peer: {note}", file=sys.stderr)
    # Untimed warm-up on both: first requests pay for shape discovery and lazy loading.
    warm = LoadShape(streams=max(counts), requests=max(counts), prompt_tokens=args.prompt_tokens,
                     output_tokens=min(args.output_tokens, 8), ignore_eos=args.ignore_eos)
    for url in (flare_url, peer_url):
        trio.run(partial(one_load, "nonstream", url, builder, warm, args.time_limit))
    pair_seeds = itertools.count(1)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    raw: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = {}
    for mode in modes:
        for streams in counts:
            shape = LoadShape(streams=streams, requests=streams * args.requests_per_stream,
                              prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                              ignore_eos=args.ignore_eos)
            sides: dict[str, list[dict[str, Any]]] = {"flare": [], "peer": []}
            for pair in range(args.pairs):
                load = shape if args.repeat_prompts else replace(shape, seed=next(pair_seeds))
                for side, url in (("flare", flare_url), ("peer", peer_url)):
                    figures = trio.run(partial(one_load, mode, url, builder, load,
                                               args.time_limit))
                    sides[side].append(figures)
                    print(f"{mode} streams={streams} pair={pair + 1}/{args.pairs} {side}: "
                          f"{figures['tokens_per_s']:.1f} tok/s", file=sys.stderr)
            raw.setdefault(mode, {})[streams] = sides
            results.setdefault(mode, {})[streams] = summarize_pairs(sides["flare"], sides["peer"])
    return {"summary": results, "loads": raw}


def main(args: argparse.Namespace) -> int:
    try:
        counts = parse_counts(args.streams)
        modes = tuple(m for m in args.modes.split(",") if m)
        unknown = sorted(set(modes) - set(MODES))
        if unknown or not modes:
            raise ValueError(f"--modes wants {' and/or '.join(MODES)}, got {args.modes!r}")
        if args.pairs < 1 or args.requests_per_stream < 1:
            raise ValueError("--pairs and --requests-per-stream must be at least 1")
    except ValueError as exc:
        print(f"flare bench peer: {exc}", file=sys.stderr)
        return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    try:
        urls: dict[str, str] = {}
        # The peer first: a peer command that cannot start fails before flare prepares.
        for name, build in (("peer", partial(peer_command, args.peer_command)),
                            ("flare", partial(flare_command, args.flare_args))):
            port = launch.free_port()
            command = build(port=port, model=args.model)
            print(f"starting {name}: {' '.join(command)}", file=sys.stderr)
            servers.append(launch.start(command, port=port, log=args.output_dir / f"{name}.log",
                                        timeout_s=args.startup_timeout))
            urls[name] = f"http://127.0.0.1:{port}"
        report = run_pairs(args, urls["flare"], urls["peer"], counts, modes)
    except launch.LaunchError as exc:
        print(f"flare bench peer: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in servers:
            launch.stop(proc)
    report["config"] = {"model": str(args.model), "peer_command": args.peer_command,
                        "flare_args": args.flare_args, "pairs": args.pairs,
                        "repeat_prompts": args.repeat_prompts,
                        "requests_per_stream": args.requests_per_stream,
                        "prompt_tokens": args.prompt_tokens,
                        "output_tokens": args.output_tokens, "ignore_eos": args.ignore_eos}
    (args.output_dir / "peer.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(format_tables(report["summary"]))
    return 0
