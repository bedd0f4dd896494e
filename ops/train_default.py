"""``flare train-default``: the recipe that builds the embedded default model pair.

It trains a byte-level BPE tokenizer and two Llama-architecture models sharing it (a target,
``models/default/``, and a smaller draft for speculative proposals, ``models/default-draft/``) on
the Python standard library's own ``.py`` files, on CPU, within a wall-clock cap per model, and
writes both as HF-format checkpoint directories. Everything is seeded and file order is sorted,
so a run with the same step counts, seed, thread count and Python/torch versions reproduces the
committed checkpoints. ``train_default_pair`` is the function other code (and tests) call.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ops.training.corpus import (
    CorpusSplit,
    build_documents,
    list_source_files,
    split_files,
    stdlib_root,
)
from ops.training.export import write_checkpoint
from ops.training.llama import LlamaForCausalLM, LlamaShape, greedy_generate
from ops.training.special_tokens import END, END_OF_TEXT, render_chat
from ops.training.tokenizer import DEFAULT_VOCAB_SIZE, special_token_ids, train_tokenizer
from ops.training.trainer import Log, TrainResult, TrainSettings, train

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPOSITORY_ROOT / "models"
TARGET_DIRECTORY = "default"
DRAFT_DIRECTORY = "default-draft"
SIZE_LIMIT_BYTES = 25 * 1000 * 1000

TARGET_SHAPE = LlamaShape(
    vocab_size=DEFAULT_VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
DRAFT_SHAPE = LlamaShape(
    vocab_size=DEFAULT_VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# For tests of the recipe itself: seconds, not minutes.
TINY_TARGET_SHAPE = LlamaShape(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
)
TINY_DRAFT_SHAPE = replace(TINY_TARGET_SHAPE, hidden_size=16, intermediate_size=32)

DEFAULT_TARGET_STEPS = 400
DEFAULT_DRAFT_STEPS = 1500
DEFAULT_MINUTES_PER_MODEL = 10.0
DEFAULT_SEED = 1234
DEFAULT_BATCH_SIZE = 4

SAMPLE_PROMPTS: tuple[str, ...] = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef ",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    render_chat(
        [("user", "Write a Python function `is_even`: Return True if n is even.")],
        add_generation_prompt=True,
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecipeSettings:
    """Everything a run depends on; the defaults build the committed pair."""

    output_root: Path = DEFAULT_OUTPUT
    target_shape: LlamaShape = TARGET_SHAPE
    draft_shape: LlamaShape = DRAFT_SHAPE
    target_steps: int = DEFAULT_TARGET_STEPS
    draft_steps: int = DEFAULT_DRAFT_STEPS
    minutes_per_model: float = DEFAULT_MINUTES_PER_MODEL
    sequence_length: int = 256
    batch_size: int = DEFAULT_BATCH_SIZE
    max_files: int | None = None
    seed: int = DEFAULT_SEED
    threads: int = 1
    sample_tokens: int = 48
    source_root: Path = field(default_factory=stdlib_root)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelReport:
    directory: Path
    parameters: int
    checkpoint_bytes: int
    result: TrainResult
    samples: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RecipeReport:
    target: ModelReport
    draft: ModelReport
    train_tokens: int
    held_out_tokens: int
    files: int
    held_out_files: int


def train_default_pair(settings: RecipeSettings, log: Log = print) -> RecipeReport:
    """Run the whole recipe and write ``default/`` and ``default-draft/`` under ``output_root``."""
    torch.set_num_threads(settings.threads)
    files = list_source_files(settings.source_root, settings.max_files)
    split = split_files(files)
    log(
        f"corpus: {len(files)} files under {settings.source_root} "
        f"({len(split.held_out_files)} held out)"
    )
    train_documents, held_out_documents = _documents(split, settings)
    started = time.monotonic()
    tokenizer = train_tokenizer(
        (d for d in train_documents if not d.startswith("<|")),
        vocab_size=settings.target_shape.vocab_size,
    )
    if tokenizer.get_vocab_size() != settings.target_shape.vocab_size:
        # A tiny corpus may not support the full vocabulary; size the models to what was learnt.
        raise ValueError(
            f"tokenizer learnt {tokenizer.get_vocab_size()} tokens, "
            f"expected {settings.target_shape.vocab_size}: use more files"
        )
    train_tokens = _encode(tokenizer, train_documents)
    held_out_tokens = _encode(tokenizer, held_out_documents)
    log(
        f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.monotonic() - started:.1f}s; "
        f"{train_tokens.numel():,} training tokens, {held_out_tokens.numel():,} held out"
    )
    reports = []
    for name, shape, steps, offset in (
        (TARGET_DIRECTORY, settings.target_shape, settings.target_steps, 0),
        (DRAFT_DIRECTORY, settings.draft_shape, settings.draft_steps, 1),
    ):
        reports.append(
            _train_one(
                name,
                shape,
                steps,
                settings.seed + offset,
                settings,
                tokenizer,
                train_tokens,
                held_out_tokens,
                log,
            )
        )
    total = sum(r.checkpoint_bytes for r in reports)
    log(f"checkpoints: {total / 1e6:.2f} MB together (limit {SIZE_LIMIT_BYTES / 1e6:.0f} MB)")
    if total > SIZE_LIMIT_BYTES:
        raise ValueError(f"checkpoints take {total} bytes, over the {SIZE_LIMIT_BYTES} limit")
    return RecipeReport(
        target=reports[0],
        draft=reports[1],
        train_tokens=train_tokens.numel(),
        held_out_tokens=held_out_tokens.numel(),
        files=len(files),
        held_out_files=len(split.held_out_files),
    )


def _train_one(
    name: str,
    shape: LlamaShape,
    steps: int,
    seed: int,
    settings: RecipeSettings,
    tokenizer: Tokenizer,
    train_tokens: torch.Tensor,
    held_out_tokens: torch.Tensor,
    log: Log,
) -> ModelReport:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape)
    model.initialise(torch.Generator().manual_seed(seed))
    log(
        f"{name}: {model.parameter_count():,} parameters, {steps} steps planned, "
        f"cap {settings.minutes_per_model:g} min"
    )
    train_settings = TrainSettings(
        steps=steps,
        max_seconds=settings.minutes_per_model * 60 if settings.minutes_per_model > 0 else math.inf,
        sequence_length=min(settings.sequence_length, shape.max_position_embeddings),
        batch_size=settings.batch_size,
        seed=seed,
    )
    result = train(
        model, train_tokens, held_out_tokens, train_settings, lambda line: log(f"{name}: {line}")
    )
    model.eval()
    samples = _samples(model, tokenizer, settings.sample_tokens)
    record = {
        "parameters": model.parameter_count(),
        "shape": asdict(shape),
        "training": asdict(result),
        "settings": {
            "sequence_length": train_settings.sequence_length,
            "batch_size": train_settings.batch_size,
            "seed": seed,
            "learning_rate": train_settings.learning_rate,
            "threads": settings.threads,
            "torch": torch.__version__,
        },
        "samples": [{"prompt": p, "greedy": s} for p, s in samples],
    }
    size = write_checkpoint(model, tokenizer, settings.output_root / name, extra=record)
    log(f"{name}: wrote {settings.output_root / name} ({size / 1e6:.2f} MB)")
    for prompt, sample in samples:
        log(f"{name}: sample {prompt!r} -> {sample!r}")
    return ModelReport(
        directory=settings.output_root / name,
        parameters=model.parameter_count(),
        checkpoint_bytes=size,
        result=result,
        samples=samples,
    )


def _documents(split: CorpusSplit, settings: RecipeSettings) -> tuple[list[str], list[str]]:
    """The recipe's training and held-out documents (seeded, so every run sees the same)."""
    return (build_documents(split.train_files, seed=settings.seed),
            build_documents(split.held_out_files, seed=settings.seed + 1))


def _encode(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.int32)


def _samples(
    model: LlamaForCausalLM, tokenizer: Tokenizer, max_new_tokens: int
) -> tuple[tuple[str, str], ...]:
    ids = special_token_ids(tokenizer)
    stops = frozenset({ids[END_OF_TEXT], ids[END]})
    out = []
    for prompt in SAMPLE_PROMPTS:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        generated = greedy_generate(model, prompt_ids, max_new_tokens, stops)
        out.append((prompt, tokenizer.decode(generated, skip_special_tokens=False)))
    return tuple(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="directory to write default/ and default-draft/ into",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="planned optimizer steps for both models (overrides the two below)",
    )
    parser.add_argument("--target-steps", type=int, default=DEFAULT_TARGET_STEPS)
    parser.add_argument("--draft-steps", type=int, default=DEFAULT_DRAFT_STEPS)
    parser.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES_PER_MODEL,
        help="wall-clock cap per model (0: none); when it binds, the learning-rate "
        "schedule follows elapsed time and the run is not bit-reproducible",
    )
    parser.add_argument(
        "--max-files",
        type=int,
        default=None,
        help="use only the first N standard-library files (for quick tries)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 keeps the run reproducible and polite)",
    )
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument(
        "--distill-draft",
        action="store_true",
        help="instead of training both models, fine-tune the draft under --output towards "
        "the target there (ops/training/distill.py; --minutes caps it, default 10)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes and vocabulary: checks the recipe in seconds",
    )


def settings_from_arguments(args: argparse.Namespace) -> RecipeSettings:
    settings = RecipeSettings(
        output_root=args.output,
        target_steps=args.steps if args.steps is not None else args.target_steps,
        draft_steps=args.steps if args.steps is not None else args.draft_steps,
        minutes_per_model=args.minutes,
        max_files=args.max_files,
        seed=args.seed,
        threads=args.threads,
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
    )
    if args.tiny:
        settings = replace(
            settings, target_shape=TINY_TARGET_SHAPE, draft_shape=TINY_DRAFT_SHAPE, sample_tokens=8
        )
    return settings


def _print_now(line: str) -> None:
    print(line, flush=True)  # progress must reach a log file while training, not at exit


def distill_draft(settings: RecipeSettings, log: Log = print) -> dict[str, object]:
    """``--distill-draft``: distil ``output_root/default-draft`` from ``output_root/default``
    on the recipe's corpus split (the committed tokenizer encodes it)."""
    from ops.training.distill import DistillSettings, distill_default_draft

    torch.set_num_threads(settings.threads)
    target_dir = settings.output_root / TARGET_DIRECTORY
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    split = split_files(list_source_files(settings.source_root, settings.max_files))
    train_tokens, held_out = (_encode(tokenizer, docs) for docs in _documents(split, settings))
    distill = DistillSettings(
        max_seconds=settings.minutes_per_model * 60 if settings.minutes_per_model > 0
        else math.inf,
        batch_size=settings.batch_size, sequence_length=settings.sequence_length,
        seed=settings.seed + 2)
    return distill_default_draft(target_dir, settings.output_root / DRAFT_DIRECTORY,
                                 train_tokens, held_out, distill, log)


def main(args: argparse.Namespace) -> int:
    if args.distill_draft:
        record = distill_draft(settings_from_arguments(args), log=_print_now)
        print(f"distilled: agreement {record['agreement_before']:.3f} -> "
              f"{record['agreement_after']:.3f}")
        return 0
    report = train_default_pair(settings_from_arguments(args), log=_print_now)
    for model in (report.target, report.draft):
        print(
            f"{model.directory}: {model.parameters:,} parameters, "
            f"{model.checkpoint_bytes:,} bytes, {model.result.steps} steps, "
            f"train loss {model.result.final_train_loss:.4f}, "
            f"held-out loss {model.result.held_out_loss:.4f}"
        )
    return 0
