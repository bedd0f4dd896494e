"""Sampling distributions as probability rows, for rejection sampling.

Speculative verification compares the target's and the draft's *sampling*
distributions, so both must be the distributions the ordinary sampler draws from:
``filtered_probs`` applies ``gpu.sampling.sample``'s own processing (the same
``clean_logits`` and ``sampler_logits``) and returns probabilities;
``processed_log_probs_by_lane`` is the log of the same distribution, what
``processed_logprobs`` programs report. Greedy rows (temperature 0) become a one-hot at the raw-logit
argmax, the token ``sample`` picks; rejection sampling between one-hot rows is exact
greedy verification, so greedy requests need no separate code path. ``greedy_tokens``
gives those argmax tokens alone, for programs that know every lane is greedy.
``acceptance_probability`` is ``sum_x min(p(x), q(x))``: the chance that rejection
sampling keeps a draft ``x ~ q`` (the learned counterfactuals' observation).
Capturable: fixed shapes, no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu.sampling import clean_logits, processed_log_probs, sampler_logits


def filtered_probs(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Probabilities ``float32 [N, V]`` of the distribution ``sample`` draws from for
    each row of ``logits [N, V]`` (parameters ``[N]``; ``min_p`` None: off). Logit
    processing, when on, is the caller's (``gpu.sampling.process_logits`` first)."""
    safe = clean_logits(logits.float())
    greedy = temperature <= 0.0
    sampled = torch.softmax(sampler_logits(safe, temperature=temperature, top_k=top_k,
                                           top_p=top_p, min_p=min_p), dim=-1)
    one_hot = torch.zeros_like(sampled).scatter(1, safe.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, sampled)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The token of each greedy row of ``logits [..., V]``: where ``filtered_probs``
    puts its one-hot for temperature 0 (the raw-logit argmax, NaN/inf cleaned the same
    way), int64 ``[...]``. Programs whose lanes are all greedy use it instead of the
    whole distribution (``verify_greedy``)."""
    return clean_logits(logits.float()).argmax(dim=-1)


def _by_lane(rule: Callable[..., torch.Tensor], logits: torch.Tensor, *,
             temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
             min_p: torch.Tensor | None) -> torch.Tensor:
    """``rule`` over the ``B * W`` rows of ``logits [B, W, V]``, each row taking its
    lane's parameters ``[B]``; ``[B, W, V]``."""
    batch, width, vocab = logits.shape

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values[:, None].expand(batch, width).reshape(-1)

    rows = rule(
        logits.reshape(batch * width, vocab), temperature=per_row(temperature),
        top_p=per_row(top_p), top_k=per_row(top_k),
        min_p=None if min_p is None else per_row(min_p),
    )
    return rows.reshape(batch, width, vocab)


def filtered_probs_by_lane(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``filtered_probs`` for ``logits [B, W, V]`` with per-lane parameters ``[B]``."""
    return _by_lane(filtered_probs, logits, temperature=temperature, top_p=top_p,
                    top_k=top_k, min_p=min_p)


def processed_log_probs_by_lane(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gpu.sampling.processed_log_probs`` (the log of ``filtered_probs``, greedy rows
    at temperature 1 instead of one-hot) for ``logits [B, W, V]`` (processed, when
    processing is on) with per-lane parameters ``[B]``; float32 ``[B, W, V]``."""
    return _by_lane(processed_log_probs, clean_logits(logits.float()),
                    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor
                           ) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` over the last axis, in [0, 1]: the probability that a
    draft drawn from ``q`` is accepted against ``p`` (kept with ``min(1, p(x)/q(x))``)."""
    return torch.minimum(target_probs, draft_probs).sum(dim=-1).clamp(0.0, 1.0)
