"""``flare bench structured``: output tokens/s with and without a JSON schema.

Runs the whole runtime in process (``open_runtime`` on the chosen backend) and, for
each stream count (default 1 and 8), alternates phases of unconstrained and
JSON-schema-constrained requests at temperature 1, side by side in one run so that a
noisy, shared machine slows both alike; each phase is repeated ``--rounds`` times and
the ratio is taken over the summed tokens and walls. A stream is one request at a time,
back to back, for ``--requests-per-stream`` requests. Unconstrained requests ignore EOS
(every one produces ``--max-tokens``); constrained ones end when the schema is
complete or at ``--max-tokens``, and tokens/s counts what they produced.

The default schema (``--json-schema FILE`` replaces it) is a list of at least 64
records, so constrained outputs run to ``--max-tokens`` like the unconstrained ones and
prefill weighs the same on both sides. The target is a constrained rate of at least 0.8x the unconstrained one.

Grammars are resident with the programs by default on the cpu backend (constrained
decode frames queue like free ones, ``gpu.grammar_rows``); ``--host-grammars`` keeps
them on the host, every constrained frame waiting for its previous token (QUEUE-13).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import structlog
import trio

from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
from actors.public import Finished, GenerationRequest, GrammarSpec, SamplingParams
from actors.system import Runtime, open_runtime
from ops.engine_flags import add_engine_flags, engine_config

DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "label": {"enum": ["a", "b", "c"]},
                       "note": {"type": "string"}},
        "required": ["id", "label", "note"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}
PROMPT = "List the records as JSON:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    add_engine_flags(parser)
    parser.add_argument("--json-schema", type=Path, default=None,
                        help="a JSON Schema file (default: a list of records)")
    parser.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternations of unconstrained and constrained phases")
    parser.add_argument("--max-batch", type=int, default=8)


async def _phase(rt: Runtime, *, streams: int, per_stream: int, max_tokens: int,
                 grammar: GrammarSpec | None) -> tuple[int, float]:
    """(output tokens, wall seconds) of ``streams`` concurrent back-to-back streams."""
    prompt = tuple(rt.codec.encode(PROMPT))
    produced = 0

    async def stream(index: int) -> None:
        nonlocal produced
        for k in range(per_stream):
            request = GenerationRequest(
                prompt_token_ids=prompt, max_tokens=max_tokens, grammar=grammar,
                sampling=SamplingParams(temperature=1.0, seed=index * 1000 + k),
                ignore_eos=grammar is None)
            async with rt.generate(request) as events:
                async for event in events:
                    if isinstance(event, Finished):
                        produced += event.completion_tokens

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(stream, i)
    return produced, trio.current_time() - start


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    schema = (json.loads(args.json_schema.read_text()) if args.json_schema is not None
              else DEFAULT_SCHEMA)
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    counts = [int(s) for s in args.streams.split(",")]
    config = RuntimeConfig(model_dir=args.model, **engine_config(args),
                           max_batch=args.max_batch, prefill_capacities=(64, 256),
                           max_queue=max(max(counts), 1))
    rows = []
    async with open_runtime(config) as rt:
        for streams in counts:  # warm-up: every shape the phases use, both kinds
            for spec in (None, grammar):
                await _phase(rt, streams=streams, per_stream=1, max_tokens=8, grammar=spec)
        for streams in counts:
            totals = {"free": [0, 0.0], "schema": [0, 0.0]}
            for _ in range(args.rounds):
                for name, spec in (("free", None), ("schema", grammar)):
                    tokens, wall = await _phase(rt, streams=streams,
                                                per_stream=args.requests_per_stream,
                                                max_tokens=args.max_tokens, grammar=spec)
                    totals[name][0] += tokens
                    totals[name][1] += wall
            free = totals["free"][0] / totals["free"][1]
            constrained = totals["schema"][0] / totals["schema"][1]
            rows.append({"streams": streams,
                         "grammars": "host" if args.host_grammars else "resident",
                         "free_tokens_per_s": round(free, 1),
                         "schema_tokens_per_s": round(constrained, 1),
                         "ratio": round(constrained / free, 3),
                         "free_tokens": totals["free"][0],
                         "schema_tokens": totals["schema"][0]})
    return rows


def main(args: argparse.Namespace) -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    for row in trio.run(bench, args):
        print(json.dumps(row))
    return 0
