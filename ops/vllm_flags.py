"""``flare run`` flags spelled as vLLM spells them (``vllm serve``), beside flare's own.

Second spellings of flare's flags (``--max-model-len`` for ``--max-context``,
``--max-num-seqs`` for ``--max-batch``, a positional MODEL for ``--model``) are declared
with the flags themselves in ``ops.run_command``; the flags here have no flare
spelling, and ``model_dir``, ``prefill_capacities`` and ``prefix_caching`` turn them
into ``RuntimeConfig`` values. docs/api.md ("vLLM flags") maps every one.
"""

from __future__ import annotations

import argparse
import math
import pathlib

import structlog

from actors.config import DEFAULT_MODEL_DIR, DEFAULT_PREFILL_CAPACITIES, ConfigError
from policy.descriptors import PROMPT_ALIGNMENT

log = structlog.get_logger("flare.run")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.9, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    vllm = parser.add_argument_group("vLLM spellings (see docs/api.md)")
    vllm.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                      help="most tokens one frame computes: the largest prefill chunk "
                           f"(a multiple of {PROMPT_ALIGNMENT}; replaces --prefill-capacity "
                           "with the default chunks below N plus N)")
    vllm.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F",
                      help="accepted for vLLM command lines and logged as ignored: the KV "
                           "pool follows --kv-pages or --max-batch on every backend")
    vllm.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                      help="a jinja chat template (a file, or the template text itself) "
                           "used instead of the tokenizer's")
    vllm.add_argument("--disable-log-requests", action="store_true",
                      help="no per-request log records (failures are still logged)")
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                      default=None,
                      help="reuse cached KV pages of shared prompt prefixes (flare's default; "
                           "--no-enable-prefix-caching computes every prompt in full)")


def model_dir(args: argparse.Namespace) -> pathlib.Path:
    """``flare run MODEL`` or ``--model MODEL`` (both only when they agree)."""
    positional, flag = args.model_path, args.model
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(f"the model is given twice: MODEL {positional} and --model {flag}")
    return positional or flag or DEFAULT_MODEL_DIR


def prefill_capacities(args: argparse.Namespace) -> tuple[int, ...]:
    """``--prefill-capacity``, or the ladder ``--max-num-batched-tokens N`` implies: the
    default chunks smaller than N, and N itself (so no frame computes more than N
    tokens)."""
    budget = args.max_num_batched_tokens
    if budget is None:
        return tuple(args.prefill_capacity or DEFAULT_PREFILL_CAPACITIES)
    if args.prefill_capacity is not None:
        raise ConfigError("--max-num-batched-tokens and --prefill-capacity both set the "
                          "prefill chunks: give one")
    if budget < PROMPT_ALIGNMENT or budget % PROMPT_ALIGNMENT:
        raise ConfigError(f"--max-num-batched-tokens must be a positive multiple of "
                          f"{PROMPT_ALIGNMENT}, got {budget}")
    return (*(c for c in DEFAULT_PREFILL_CAPACITIES if c < budget), budget)


def prefix_caching(args: argparse.Namespace) -> bool:
    return args.enable_prefix_caching is not False
