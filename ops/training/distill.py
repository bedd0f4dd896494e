"""Distilling the draft from the target: ``flare train-default --distill-draft``.

A learned proposal is accepted where the draft agrees with the target (ACC-5): greedily,
where their top tokens match; when sampling, by ``min(1, p/q)``. The recipe's draft was
trained on the corpus alone, so it predicts the *corpus*, not the target, and the target's
own greedy text (the repetitive continuations a small model writes) is a context it never
saw. Distillation fine-tunes the committed draft towards the target's next-token
distributions (soft-label cross-entropy, the KL divergence up to a constant) on two
streams, half of each batch from each:

- windows of the training corpus, and
- the target's own greedy continuations of corpus prompts, generated with flare's engine
  (``gpu.programs.driver.ReferenceDriver``: paged KV, batched decode), which is what a
  serving draft proposes against.

The student starts from the draft checkpoint and keeps its shape, so the pair's programs
and catalog are unchanged; the run's record is added to the draft's
``flare_training.json`` under ``distillation``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ops.training.llama import LlamaForCausalLM, LlamaShape
from ops.training.trainer import Log, TrainResult, TrainSettings, train


@dataclass(frozen=True, slots=True, kw_only=True)
class DistillSettings:
    """How the draft is distilled (defaults: the committed run)."""

    steps: int = 2000
    max_seconds: float = 600.0
    sequence_length: int = 256
    batch_size: int = 4
    learning_rate: float = 1e-3
    seed: int = 1236
    prompts: int = 96
    """Corpus prompts the target continues greedily (the second stream)."""
    prompt_tokens: int = 32
    continuation_tokens: int = 224
    generation_batch: int = 16


def load_model(directory: Path) -> LlamaForCausalLM:
    """A training-side model from an HF-format checkpoint written by ``write_checkpoint``."""
    config = json.loads((directory / "config.json").read_text())
    shape = LlamaShape(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_theta=config.get("rope_theta", 10000.0), rms_norm_eps=config["rms_norm_eps"],
        tie_word_embeddings=config.get("tie_word_embeddings", True),
    )
    model = LlamaForCausalLM(shape)
    missing, unexpected = model.load_state_dict(
        load_file(str(directory / "model.safetensors")), strict=False)
    allowed = {"lm_head.weight"} if shape.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"{directory}: checkpoint does not match its config "
                         f"(missing {missing}, unexpected {unexpected})")
    return model


def target_continuations(target_dir: Path, prompts: torch.Tensor, new_tokens: int, *,
                         batch: int) -> torch.Tensor:
    """The target's greedy continuations of ``prompts [N, P]``: ``[N, P + new_tokens]``,
    decoded by flare's own engine (a page pool, ``batch`` rows per decode frame)."""
    from gpu.engine import ModelEngine
    from gpu.programs.driver import ReferenceDriver
    from policy.descriptors import GraphKind, GraphShape

    count, prompt_len = prompts.shape
    batch = max(1, min(batch, count))
    page_size = 16
    length = prompt_len + new_tokens
    prefill = GraphShape(kind=GraphKind.PREFILL, batch_capacity=1,
                         token_capacity=max(64, -(-prompt_len // 64) * 64))
    decode = GraphShape(kind=GraphKind.DECODE, batch_capacity=batch, token_capacity=1)
    pages = batch * -(-(length + 1) // page_size) + 1
    engine = ModelEngine.load(target_dir, device="cpu", dtype=None, catalog=(prefill, decode),
                              page_size=page_size, num_pages=pages, state_rows=batch,
                              require_tokenizer=False)
    out = []
    for first in range(0, count, batch):
        group = prompts[first:first + batch].tolist()
        driver = ReferenceDriver(engine)
        rows = list(range(len(group)))
        sequences = [[*p, driver.prefill(prefill, r, p, chunk=prefill.token_capacity)]
                     for r, p in zip(rows, group, strict=True)]
        while len(sequences[0]) < length:
            for row, token in zip(rows, driver.decode(decode, rows), strict=True):
                sequences[row].append(token)
        out.extend(s[:length] for s in sequences)
    return torch.tensor(out, dtype=torch.int32)


def agreement(student: LlamaForCausalLM, teacher: LlamaForCausalLM, tokens: torch.Tensor
              ) -> float:
    """Share of positions of ``tokens [N, L]`` where the student's top token is the
    teacher's (what greedy verification accepts)."""
    with torch.no_grad():
        was_training = student.training
        student.eval()
        same = student(tokens.long()).argmax(-1) == teacher(tokens.long()).argmax(-1)
        student.train(was_training)
    return float(same.float().mean())


def distill(student: LlamaForCausalLM, teacher: LlamaForCausalLM, corpus: torch.Tensor,
            continuations: torch.Tensor, held_out: torch.Tensor, settings: DistillSettings,
            log: Log) -> TrainResult:
    """Fine-tune ``student`` in place towards ``teacher`` on corpus windows and the
    teacher's continuations (half of each batch from each)."""
    teacher.eval()
    return train(student, corpus, held_out, TrainSettings(
        steps=settings.steps, max_seconds=settings.max_seconds,
        sequence_length=min(settings.sequence_length, student.shape.max_position_embeddings,
                            continuations.shape[1] - 1),
        batch_size=settings.batch_size, learning_rate=settings.learning_rate,
        warmup_steps=10, seed=settings.seed,
    ), log, teacher=teacher, second_stream=continuations.flatten())


def distill_default_draft(target_dir: Path, draft_dir: Path, corpus: torch.Tensor,
                          held_out: torch.Tensor, settings: DistillSettings, log: Log
                          ) -> dict[str, object]:
    """Distil ``draft_dir``'s model from ``target_dir``'s and write it back in place;
    returns the record added to its ``flare_training.json``."""
    from ops.training.export import write_checkpoint

    generator = torch.Generator().manual_seed(settings.seed)
    starts = torch.randint(0, corpus.numel() - settings.prompt_tokens, (settings.prompts,),
                           generator=generator)
    prompts = torch.stack([corpus[int(s):int(s) + settings.prompt_tokens] for s in starts])
    teacher, student = load_model(target_dir), load_model(draft_dir)
    new_tokens = min(settings.continuation_tokens,
                     teacher.shape.max_position_embeddings - settings.prompt_tokens - 1)
    started = time.monotonic()
    continuations = target_continuations(target_dir, prompts, new_tokens,
                                         batch=settings.generation_batch)
    log(f"distill: {len(continuations)} target continuations of {new_tokens} tokens in "
        f"{time.monotonic() - started:.0f}s")
    probe = continuations[-8:]
    before = agreement(student, teacher, probe)
    result = distill(student, teacher, corpus, continuations[:-8], held_out, settings, log)
    after = agreement(student, teacher, probe)
    log(f"distill: top-token agreement with the target on held-out continuations "
        f"{before:.3f} -> {after:.3f}")
    record_path = draft_dir / "flare_training.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    distillation = {
        "teacher": target_dir.name, "result": asdict(result),
        "settings": {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                     for k, v in asdict(settings).items()},
        "agreement_before": before, "agreement_after": after, "torch": torch.__version__,
    }
    record["distillation"] = distillation
    student.eval()
    write_checkpoint(student, Tokenizer.from_file(str(draft_dir / "tokenizer.json")),
                     draft_dir, extra=record)
    return distillation
