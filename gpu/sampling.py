"""Sampling: logit processing, greedy, temperature, top-k, top-p, min-p, with
counter-based randomness.

Owns token selection from logits. Randomness is a pure integer hash of (request seed,
sequence position, vocabulary index) computed with torch int64 ops, turned into Gumbel
noise (Gumbel-max sampling), so the same seed gives the same tokens whatever else is
in the batch, and sampling is capturable: no global generator, no host sync, no
data-dependent shapes. Greedy rows (temperature 0) take the argmax.

Also owns the two distributions reported logprobs come from, vLLM's two
``logprobs_mode`` values: ``reported_log_probs`` (``raw_logprobs``, the default: the
raw model distribution, whatever the sampling filters) and ``processed_log_probs``
(``processed_logprobs``: the distribution the sampler draws from, the one rule
``sampler_logits``), and the fixed-width top alternatives every program reports
(``top_alternatives``).

Logit processing (``process_logits``: logit bias, repetition / frequency / presence
penalties, the ``min_tokens`` mask) runs first, on the cleaned logits, so it changes the
greedy argmax too (as in vLLM); ``min_p`` is a filter beside top-k and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpu.grammar_mask import mask_disallowed

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 keep every product of a 32-bit value inside int64.
_MUL_A = 0x7FEB352D
_MUL_B = 0x68E31DA5
_MUL_C = 0x4F6CDD1D


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of non-negative int64 values below 2**32 (the one hash
    every counter-based draw is built from)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL_C) & _MASK32
    return x ^ (x >> 15)


def counter_uniform(seed: torch.Tensor, position: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform floats in (0, 1), shape ``[N, width]``, a pure function of
    (seed[n], position[n], column). ``seed`` and ``position`` are int64 ``[N]``."""
    seed_lo = seed & _MASK32
    seed_hi = (seed >> 32) & _MASK32
    row_key = mix32(seed_lo ^ mix32(seed_hi ^ mix32(position & _MASK32)))
    column = torch.arange(width, device=seed.device, dtype=torch.int64)
    h = mix32(row_key[:, None] ^ mix32(column[None, :] + 0x9E3779B9 & _MASK32))
    # 24 high bits -> exactly representable float32 in (0, 1).
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def clean_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (float32) with NaN and infinities replaced by large finite values, so
    every later step (softmax, sort, argmax) is defined on every row."""
    return torch.nan_to_num(logits, nan=-1e30, posinf=1e30, neginf=-1e30)


def reported_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The distribution every reported logprob comes from, float32 ``[..., V]``: the
    model's raw log-softmax (temperature 1, before top-k/top-p filtering), with
    non-finite logits cleaned (``clean_logits``). This is vLLM's default
    ``logprobs_mode`` (``raw_logprobs``) and what OpenAI reports; sampled tokens,
    their top alternatives and speculative rounds use it unless the programs run with
    ``processed_logprobs`` (``processed_log_probs``); scored prompts always do (no
    sampler draws a prompt token)."""
    return torch.log_softmax(clean_logits(logits.float()), dim=-1)


def processed_log_probs(processed: torch.Tensor, *, temperature: torch.Tensor,
                        top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The ``processed_logprobs`` distribution, float32 ``[N, V]``: the log of the
    distribution each row's token is drawn from, ``log_softmax(sampler_logits(...))``
    of ``processed`` (logits already cleaned, grammar-masked and processed). Tokens the
    filters remove are ``-inf``; greedy rows (temperature 0) get their temperature-1
    distribution with the filters applied (as in vLLM)."""
    masked = sampler_logits(processed, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p)
    return torch.log_softmax(masked, dim=-1)


def top_alternatives(log_probs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` most likely tokens of each row of ``log_probs [..., V]``, best first:
    ``(ids int64 [..., width], logprobs float32 [..., width])``."""
    top_lp, top_id = log_probs.topk(width, dim=-1)
    return top_id, top_lp


_FORBIDDEN = -1e30
"""The logit of a token ``min_tokens`` forbids (finite, like ``clean_logits``' floor:
softmax gives it exactly zero mass)."""


@dataclass(frozen=True, slots=True)
class RowProcessing:
    """The logit-processing state of ``N`` sampled rows (``RequestState.processing``):
    parameters ``[N]``, per-token state ``[N, V]``, the sparse logit bias ``[N, K]``."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    min_p: torch.Tensor
    bias_ids: torch.Tensor
    """``[N, K]`` token ids of the logit bias (padding: id 0 with bias 0)."""
    bias_values: torch.Tensor
    counts: torch.Tensor
    """Output-token counts (float32)."""
    prompt_seen: torch.Tensor
    end_tokens: torch.Tensor
    """Tokens that end the request, forbidden while ``generated < min_tokens``."""
    generated: torch.Tensor
    min_tokens: torch.Tensor


def process_logits(safe: torch.Tensor, processing: RowProcessing) -> torch.Tensor:
    """``safe [N, V]`` (cleaned logits) with each row's processing applied, in vLLM's
    order: add the logit bias; divide positive (multiply negative) logits of tokens
    seen in the prompt or the output by the repetition penalty; subtract
    ``frequency * count + presence * [count > 0]`` over output counts; forbid the
    ending tokens while fewer than ``min_tokens`` were generated. Every parameter at
    its neutral value leaves a row unchanged, bit for bit."""
    p = processing
    counts = p.counts
    present = counts > 0
    out = safe.scatter_add(1, p.bias_ids, p.bias_values)
    repetition = p.repetition[:, None]
    penalised = torch.where(out > 0, out / repetition, out * repetition)
    out = torch.where(p.prompt_seen | present, penalised, out)
    out = out - p.frequency[:, None] * counts - p.presence[:, None] * present.to(out.dtype)
    early = (p.generated < p.min_tokens)[:, None]
    return out.masked_fill(early & p.end_tokens, _FORBIDDEN)


def processing_after_drafts(processing: RowProcessing, drafts: torch.Tensor) -> RowProcessing:
    """The processing state for each target row of a speculative round, ``B * W`` rows
    (lane-major): row ``i`` of a lane sees the lane's state as it would be after its
    drafts ``0..i-1`` were emitted (``drafts int64 [B, W-1]``; negative: absent), so
    verifying row ``i`` uses the distribution the ordinary sampler would use there."""
    batch, depth = drafts.shape
    width = depth + 1
    p = processing
    vocab = p.counts.shape[-1]
    emitted = torch.zeros((batch, width, vocab), dtype=p.counts.dtype, device=p.counts.device)
    if depth:
        emitted[:, 1:].scatter_add_(2, drafts.clamp(min=0)[..., None],
                                    (drafts >= 0).to(emitted.dtype)[..., None])
    counts = p.counts[:, None] + emitted.cumsum(dim=1)

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values[:, None].expand(batch, width, *values.shape[1:]).reshape(
            batch * width, *values.shape[1:])

    step = torch.arange(width, device=drafts.device)[None, :]
    return RowProcessing(
        presence=per_row(p.presence), frequency=per_row(p.frequency),
        repetition=per_row(p.repetition), min_p=per_row(p.min_p),
        bias_ids=per_row(p.bias_ids), bias_values=per_row(p.bias_values),
        counts=counts.reshape(batch * width, vocab), prompt_seen=per_row(p.prompt_seen),
        end_tokens=per_row(p.end_tokens),
        generated=(p.generated[:, None] + step).reshape(-1), min_tokens=per_row(p.min_tokens),
    )


def min_p_keep(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Which tokens of ``scaled [N, V]`` pass each row's min-p filter, bool ``[N, V]``:
    probability at least ``min_p`` times the row's most likely token's (0 keeps all;
    the most likely token is always kept)."""
    probs = torch.softmax(scaled, dim=-1)
    return probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)


def scale_by_temperature(safe: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``safe [N, V]`` divided by each row's temperature; greedy rows (temperature 0)
    are left unscaled."""
    return safe / torch.where(temperature <= 0.0, 1.0, temperature)[:, None]


def top_k_top_p_keep(scaled: torch.Tensor, *, top_k: torch.Tensor, top_p: torch.Tensor
                     ) -> torch.Tensor:
    """Which tokens of each row of ``scaled [N, V]`` survive the filters, bool ``[N, V]``:
    the ``top_k`` most likely (0 means all), then top-p on the top-k-renormalised mass
    (a token is kept while the mass before it is under ``top_p``); the most likely
    token is always kept."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device, dtype=torch.int64)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    keep_sorted = rank < k
    probs_sorted = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    keep_sorted &= mass_before < top_p[:, None]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def sampler_logits(processed: torch.Tensor, *, temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of the distribution the sampler draws each row of ``processed [N, V]``
    from (parameters ``[N]``; ``min_p`` None: off): divided by the row's temperature
    (greedy rows unscaled), with every token top-k, top-p or min-p removes at ``-inf``.
    The one rule ``sample``, speculative verification (``filtered_probs``) and
    ``processed_log_probs`` share."""
    scaled = scale_by_temperature(processed, temperature)
    keep = top_k_top_p_keep(scaled, top_k=top_k, top_p=top_p)
    if min_p is not None:
        keep &= min_p_keep(scaled, min_p)
    return scaled.masked_fill(~keep, float("-inf"))


def reads_parameters(*, greedy_only: bool, processed_logprobs: bool) -> bool:
    """Whether ``sample`` reads the sampling parameters (temperature, top-k, top-p, seed,
    position): always, except for a greedy-only call that reports the raw
    distribution."""
    return not greedy_only or processed_logprobs


class Sampled(NamedTuple):
    """What ``sample`` returns, one entry per row: the token, its logprob and the
    ``top_width`` most likely alternatives, under ``reported_log_probs`` or, with
    ``processed_logprobs``, ``processed_log_probs``."""

    token: torch.Tensor  # int64 [N]
    logprob: torch.Tensor  # float32 [N]
    finite: torch.Tensor  # bool [N]: every logit of the row was finite
    top_ids: torch.Tensor  # int64 [N, top_width]
    top_logprobs: torch.Tensor  # float32 [N, top_width]


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None,
    top_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    seed: torch.Tensor | None,
    position: torch.Tensor | None,
    greedy_only: bool = False,
    top_width: int = 0,
    processing: RowProcessing | None = None,
    token_mask: torch.Tensor | None = None,
    processed_logprobs: bool = False,
) -> Sampled:
    """Sample one token per row of ``logits [N, V]``.

    ``token_mask`` (int32 words ``[N, ceil(V/32)]``, ``gpu.grammar_mask``) removes the
    tokens a row's grammar disallows before anything else. The logprob and the
    ``top_width`` alternatives are under ``reported_log_probs`` of what remains: the
    model's temperature-1 distribution, unprocessed and unfiltered (renormalised over
    the grammar's tokens for a constrained row). ``greedy_only`` (a host-known promise
    that every row has temperature 0, made by eager programs) skips the stochastic
    pipeline; the result is the same, and the sampling parameters may then be None
    (``reads_parameters`` says when they are read). ``processing`` (None:
    every row's is off) is
    applied next, greedy rows included (``process_logits``), and adds the min-p filter.
    ``processed_logprobs`` (a host constant, ``--logprobs-mode processed_logprobs``)
    reports ``processed_log_probs`` instead: the distribution the token was drawn from.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    finite = torch.isfinite(logits).all(dim=-1)
    cleaned = clean_logits(logits)
    safe = mask_disallowed(cleaned, token_mask)
    log_probs = None
    if not processed_logprobs:
        # reported_log_probs(safe); unmasked, ``safe`` is already clean
        log_probs = (reported_log_probs(safe) if token_mask is not None
                     else torch.log_softmax(cleaned, dim=-1))
    if processing is not None:
        safe = process_logits(safe, processing)
    greedy_token = safe.argmax(dim=-1)
    if greedy_only and log_probs is not None:
        top_ids, top_logprobs = top_alternatives(log_probs, top_width)
        logprob = log_probs.gather(1, greedy_token[:, None]).squeeze(1)
        return Sampled(greedy_token, logprob, finite, top_ids, top_logprobs)
    assert temperature is not None and top_k is not None and top_p is not None, \
        "sample() reads the sampling parameters here (reads_parameters)"

    greedy = temperature <= 0.0
    drawn_from = sampler_logits(safe, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=None if processing is None else processing.min_p)
    if log_probs is None:
        log_probs = torch.log_softmax(drawn_from, dim=-1)  # processed_log_probs
    top_ids, top_logprobs = top_alternatives(log_probs, top_width)
    if greedy_only:
        logprob = log_probs.gather(1, greedy_token[:, None]).squeeze(1)
        return Sampled(greedy_token, logprob, finite, top_ids, top_logprobs)

    assert seed is not None and position is not None, "reads_parameters"
    uniform = counter_uniform(seed, position, vocab)
    gumbel = -torch.log(-torch.log(uniform))
    sampled_token = (drawn_from + gumbel).argmax(dim=-1)

    token = torch.where(greedy, greedy_token, sampled_token)
    logprob = log_probs.gather(1, token[:, None]).squeeze(1)
    return Sampled(token, logprob, finite, top_ids, top_logprobs)
