"""The training loop for the default models: random windows of one token stream, AdamW,
warmup then cosine decay over a planned number of steps, stopped early by a wall-clock cap.

With ``max_seconds`` large enough to finish the planned steps, a run is deterministic for a
given seed, torch version and thread count (windows come from a seeded generator). Progress
(step, loss, tokens per second) goes to the ``log`` callable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops.training.llama import LlamaForCausalLM

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSettings:
    """How one model is trained."""

    steps: int
    max_seconds: float = math.inf
    sequence_length: int = 256
    batch_size: int = 16
    learning_rate: float = 3e-3
    final_learning_rate_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    gradient_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_windows: int = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainResult:
    """What a run did; losses are mean next-token cross-entropy in nats."""

    steps: int
    planned_steps: int
    tokens_seen: int
    seconds: float
    final_train_loss: float
    held_out_loss: float
    stopped_by_time: bool


def learning_rate_at(step: int, settings: TrainSettings, elapsed_seconds: float = 0.0) -> float:
    """Linear warmup to the peak, then cosine down to ``final_learning_rate_ratio`` of it.

    Progress is the larger of the step fraction and the elapsed fraction of ``max_seconds``, so
    a run cut short by its time cap still finishes its decay. Without a cap (``max_seconds`` is
    infinite) the schedule depends on the step alone and the run is exactly reproducible.
    """
    peak = settings.learning_rate
    warmup = min(settings.warmup_steps, max(1, settings.steps // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, settings.steps - warmup)
    progress = max((step - warmup) / span, elapsed_seconds / settings.max_seconds)
    progress = min(1.0, progress)
    floor = settings.final_learning_rate_ratio
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(
    model: LlamaForCausalLM,
    train_tokens: torch.Tensor,
    held_out_tokens: torch.Tensor,
    settings: TrainSettings,
    log: Log,
    *,
    teacher: LlamaForCausalLM | None = None,
    second_stream: torch.Tensor | None = None,
) -> TrainResult:
    """Train ``model`` in place on windows of ``train_tokens``; evaluate on ``held_out_tokens``.

    With a ``teacher`` the loss is the cross-entropy against the teacher's next-token
    distribution instead of the next token (distillation, ``ops.training.distill``);
    with a ``second_stream`` half of each batch's windows come from it."""
    length = settings.sequence_length
    if train_tokens.numel() <= length + 1:
        raise ValueError("training stream is shorter than one window")
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = _optimizer(model, settings)
    model.train()
    recent: list[float] = []
    started = time.monotonic()
    last_log, tokens_at_last_log = started, 0
    step = 0
    stopped_by_time = False
    while step < settings.steps:
        elapsed = time.monotonic() - started
        if elapsed > settings.max_seconds:
            stopped_by_time = True
            break
        learning_rate = learning_rate_at(step, settings, elapsed)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        if second_stream is None:
            batch = _random_windows(train_tokens, settings.batch_size, length + 1, generator)
        else:
            half = settings.batch_size // 2
            batch = torch.cat((
                _random_windows(train_tokens, settings.batch_size - half, length + 1, generator),
                _random_windows(second_stream, half, length + 1, generator)))
        logits = model(batch[:, :-1])
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   batch[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                teacher_logits = teacher(batch[:, :-1])
            loss = _soft_label_loss(logits, teacher_logits)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.gradient_clip)
        optimizer.step()
        step += 1
        loss_value = loss.item()
        recent = [*recent[-49:], loss_value]
        if step % settings.log_every == 0 or step == settings.steps:
            now = time.monotonic()
            tokens = step * settings.batch_size * length
            rate = (tokens - tokens_at_last_log) / max(now - last_log, 1e-9)
            log(
                f"step {step}/{settings.steps} loss {loss_value:.4f} "
                f"lr {learning_rate:.2e} tokens/s {rate:,.0f} "
                f"elapsed {now - started:.0f}s"
            )
            last_log, tokens_at_last_log = now, tokens
    seconds = time.monotonic() - started
    held_out = evaluate(model, held_out_tokens, length, settings.eval_windows)
    log(
        f"done: {step} steps in {seconds:.0f}s, train loss {_mean(recent):.4f}, "
        f"held-out loss {held_out:.4f}"
    )
    return TrainResult(
        steps=step,
        planned_steps=settings.steps,
        tokens_seen=step * settings.batch_size * length,
        seconds=seconds,
        final_train_loss=_mean(recent),
        held_out_loss=held_out,
        stopped_by_time=stopped_by_time,
    )


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, tokens: torch.Tensor, length: int, windows: int) -> float:
    """Mean loss over up to ``windows`` evenly spaced, non-overlapping windows of ``tokens``."""
    was_training = model.training
    model.eval()
    available = (tokens.numel() - 1) // length
    count = min(windows, available)
    if count == 0:
        return float("nan")
    stride = available // count
    starts = [i * stride * length for i in range(count)]
    total = 0.0
    for chunk in range(0, count, 16):
        batch = torch.stack([tokens[s : s + length + 1] for s in starts[chunk : chunk + 16]]).long()
        logits = model(batch[:, :-1])
        total += float(
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
        )
    model.train(was_training)
    return total / (count * length)


def _optimizer(model: LlamaForCausalLM, settings: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.learning_rate,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _random_windows(
    tokens: torch.Tensor, count: int, width: int, generator: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - width, (count,), generator=generator)
    return torch.stack([tokens[int(s) : int(s) + width] for s in starts]).long()


def _soft_label_loss(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against the teacher's softmax, mean over positions:
    KL(teacher || model) plus the teacher's entropy."""
    targets = F.softmax(teacher_logits.float(), dim=-1)
    return -(targets * F.log_softmax(logits.float(), dim=-1)).sum(dim=-1).mean()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
