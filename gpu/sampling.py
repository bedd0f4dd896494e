"""Sampling: greedy, temperature, top-k, top-p, with counter-based randomness.

Owns token selection from logits. Randomness is a pure integer hash of (request seed,
sequence position, vocabulary index) computed with torch int64 ops, turned into Gumbel
noise (Gumbel-max sampling), so the same seed gives the same tokens whatever else is
in the batch, and sampling is capturable: no global generator, no host sync, no
data-dependent shapes. Greedy rows (temperature 0) take the argmax.
"""

from __future__ import annotations

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


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    greedy_only: bool = False,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits [N, V]``.

    Returns ``(token int64 [N], logprob float32 [N], finite bool [N])``; the logprob is
    under the unfiltered temperature-1 distribution (what OpenAI ``logprobs`` report).
    ``greedy_only`` (a host-known promise that every row has temperature 0, made by
    eager programs) skips the stochastic pipeline; the result is the same.
    ``token_mask`` (int32 words ``[N, ceil(V/32)]``, ``gpu.grammar_mask``) removes the
    tokens a row's grammar disallows before anything else: they get ``-inf``, so the
    logprob is then under the grammar-renormalised temperature-1 distribution.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    finite = torch.isfinite(logits).all(dim=-1)
    safe = mask_disallowed(clean_logits(logits), token_mask)
    log_probs = torch.log_softmax(safe, dim=-1)
    greedy_token = safe.argmax(dim=-1)
    if greedy_only:
        return greedy_token, log_probs.gather(1, greedy_token[:, None]).squeeze(1), finite

    greedy = temperature <= 0.0
    scaled = scale_by_temperature(safe, temperature)
    keep = top_k_top_p_keep(scaled, top_k=top_k, top_p=top_p)

    uniform = counter_uniform(seed, position, vocab)
    gumbel = -torch.log(-torch.log(uniform))
    noisy = scaled.masked_fill(~keep, float("-inf")) + gumbel
    sampled_token = noisy.argmax(dim=-1)

    token = torch.where(greedy, greedy_token, sampled_token)
    logprob = log_probs.gather(1, token[:, None]).squeeze(1)
    return token, logprob, finite
