"""``flare bench grammar``: structured-output libraries compared on the served vocabulary.

For each library installed among llguidance (what flare ships), xgrammar and
outlines-core: compile a JSON schema grammar over the model's ``tokenizer.json``
(loaded with ``tokenizers``), then step a matcher through one valid, compact JSON
document token by token, timing the next-token mask computation before every token
(the host work a constrained request adds to each frame). Prints compile time, mask
time per token (mean, p50, p99) and the library's import time, as JSON lines.

xgrammar and outlines-core are not dependencies of flare: install them into a separate
target to compare (``pip install --target DIR --no-deps xgrammar==0.2.9
apache-tvm-ffi==0.1.15.post2 outlines-core==0.2.14`` and ``PYTHONPATH=DIR``); a library
that is not importable is reported as skipped. xgrammar imports torch and transformers
at import time (its declared dependencies, with triton).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from actors.config import DEFAULT_MODEL_DIR

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
"""The benchmark schema: required fields, an enum, integers, an array, a nested object."""

DOCUMENT: dict[str, Any] = {
    "name": "Ada Lovelace", "age": 36, "role": "admin",
    "tags": ["math", "poetry", "engines", "notes"],
    "address": {"city": "London", "zip": 10001},
}
"""A valid instance, stepped through in its compact form."""

Stepper = Callable[[list[int]], tuple[float, list[float]]]
"""Given the document's tokens: (compile seconds, mask seconds before each token)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help="model directory holding tokenizer.json (default: embedded)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="document passes per library (default 5)")
    parser.add_argument("--libraries", default="llguidance,xgrammar,outlines_core",
                        help="comma-separated subset to run")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (the tokenizer's ByteLevel pieces)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    decoder = _byte_decoder()
    pieces: list[bytes] = [b""] * vocab_size
    for piece, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            pieces[index] = (bytes(decoder[c] for c in piece)
                             if all(c in decoder for c in piece) else piece.encode())
    return pieces


Matcher = tuple[Callable[[], object], Callable[[int], object]]
"""A fresh matcher as (compute the next mask, consume a token: falsy when refused)."""


def _stepper(compile_matcher: Callable[[], Matcher]) -> Stepper:
    """Time ``compile_matcher`` and each mask of a pass over the document's tokens."""
    def step(tokens: list[int]) -> tuple[float, list[float]]:
        start = time.perf_counter()
        compute_mask, consume = compile_matcher()
        compiled = time.perf_counter() - start
        times = []
        for token in tokens:
            t0 = time.perf_counter()
            compute_mask()
            times.append(time.perf_counter() - t0)
            if consume(token) is False:
                raise RuntimeError(f"the matcher refused token {token}")
        return compiled, times
    return step


def _llguidance(tokenizer: Tokenizer, vocab_size: int, eos: int) -> Stepper:
    import llguidance

    lltok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
    mask = np.empty((vocab_size + 31) // 32, dtype=np.int32)

    def compile_matcher() -> Matcher:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False})  # type: ignore[arg-type]
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        return (lambda: matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes),
                matcher.consume_token)
    return _stepper(compile_matcher)


def _xgrammar(tokenizer: Tokenizer, vocab_size: int, eos: int) -> Stepper:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(_token_bytes(tokenizer, vocab_size), xgr.VocabType.RAW,
                             vocab_size=vocab_size, stop_token_ids=[eos])
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile_matcher() -> Matcher:
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")))
        return lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token
    return _stepper(compile_matcher)


def _outlines_core(tokenizer: Tokenizer, vocab_size: int, eos: int) -> Stepper:
    import outlines_core

    mapping: dict[bytes, list[int]] = {}
    for index, piece in enumerate(_token_bytes(tokenizer, vocab_size)):
        if piece and index != eos:
            mapping.setdefault(piece, []).append(index)
    vocabulary = outlines_core.Vocabulary(eos, mapping)
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def compile_matcher() -> Matcher:
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA), "")
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        return (lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4),
                lambda token: guide.advance(token, return_tokens=False))  # raises if refused
    return _stepper(compile_matcher)


LIBRARIES: dict[str, Callable[[Tokenizer, int, int], Stepper]] = {
    "llguidance": _llguidance, "xgrammar": _xgrammar, "outlines_core": _outlines_core,
}


def _config_vocab(model: Path, tokenizer: Tokenizer) -> int:
    config = json.loads((model / "config.json").read_text())
    return int(config.get("vocab_size", tokenizer.get_vocab_size(with_added_tokens=True)))


def _import_cost(name: str) -> tuple[float, list[str]]:
    """Seconds to import ``name`` in a fresh interpreter, and which of torch,
    transformers and triton that import loads (its dependency weight)."""
    probe = (f"import sys, time; t = time.perf_counter(); import {name}; "
             "print(time.perf_counter() - t); "
             "print(','.join(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return float(out[0]), [m for m in out[1].split(",") if m] if len(out) > 1 else []


def main(args: argparse.Namespace) -> int:
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    vocab_size = _config_vocab(args.model, tokenizer)
    eos = 0
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tokenizer.encode(text, add_special_tokens=False).ids
    print(json.dumps({"model": str(args.model), "vocab_size": vocab_size,
                      "document_tokens": len(tokens)}))
    for name in args.libraries.split(","):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(json.dumps({"library": name, "skipped": str(exc)}))
            continue
        imported, heavy = _import_cost(name)
        step = LIBRARIES[name](tokenizer, vocab_size, eos)
        compiles, masks = [], []
        for _ in range(args.repeat):
            compiled, times = step(tokens)
            compiles.append(compiled)
            masks.extend(times)
        masks.sort()
        print(json.dumps({
            "library": name, "import_s": round(imported, 3),
            "compile_ms": round(statistics.median(compiles) * 1e3, 3),
            "mask_us_mean": round(statistics.fmean(masks) * 1e6, 1),
            "mask_us_p50": round(masks[len(masks) // 2] * 1e6, 1),
            "mask_us_p99": round(masks[min(len(masks) - 1, int(len(masks) * 0.99))] * 1e6, 1),
            "imports_heavy_modules": heavy,
        }))
    return 0
