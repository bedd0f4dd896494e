"""Execution options of prepared programs: static bounds (capturable) or host-known
bounds computed in ``bind`` (eager backends only).

A prepared program keeps one fixed *physical* shape (its cost identity: lanes, token
slots, prompt capacity). How much of the context its attention reads is a separate
choice:

- **static** (``ExecutionOptions.static()``, the CUDA default): attention gathers every
  lane's block table up to ``max_context``. ``execute`` has the same shapes on every
  launch, so it can be captured once into a CUDA graph and replayed.
- **dynamic context** (``ExecutionOptions.eager()``, the CPU default): ``bind`` runs in
  stream order right before ``execute`` on the same host thread, so it can read the
  device-resident positions of the frame's rows (plain host tensors on the CPU, no
  synchronisation) and compute the largest context any active lane needs. ``execute``
  then gathers exactly the blocks covering it (no rounding: a captured forward's graph
  follows the table's width, ``gpu.model.capture``, so the bound costs no extra
  shapes). Keys past a query's position are masked either way, so the tokens are the
  same as with the static bound (tests check it); only the work shrinks with the
  actual contexts.
- **greedy shortcut** (also eager only): when every active lane samples greedily,
  ``execute`` skips the sort/top-p/noise pipeline of ``gpu.sampling.sample`` whose
  result greedy lanes discard anyway.
- **captured forward** (CPU only): the decoder forward of each input shape is traced
  once into a TorchScript graph that runs without the interpreter lock
  (``gpu.model.capture``), the CPU counterpart of a CUDA graph replay. A frame whose
  lanes are all greedy and ask for no top alternatives, mask or logit processing (the
  host bounds say so) replays the whole ``execute`` body instead, indices, forward,
  vocabulary projection, sampling and outputs, as one traced step
  (``gpu.programs.step_body``); other frames replay the forward and run the rest op by
  op. A program's first launch captures both graphs.

- **processed logprobs** (any backend: a host constant, not a bound): programs report
  ``gpu.sampling.processed_log_probs`` (the distribution the sampler draws from)
  instead of the raw ``reported_log_probs`` (``--logprobs-mode``).

Both dynamic options make ``execute`` depend on a host value chosen in ``bind``, which a
captured graph cannot follow, so ``ModelEngine.load`` refuses them on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionOptions:
    """How prepared step programs bound their work (see the module docstring)."""

    dynamic_context: bool = False
    """Gather only the blocks the frame's lanes need."""
    greedy_shortcut: bool = False
    """Skip the stochastic sampling pipeline when every active lane is greedy."""
    capture_forward: bool = False
    """Trace the decoder forward once per input shape and replay the graph (CPU)."""
    processed_logprobs: bool = False
    """Report logprobs of the distribution the sampler draws from (vLLM's
    ``processed_logprobs``) instead of the raw model distribution (``raw_logprobs``)."""

    @property
    def host_bounds(self) -> bool:
        """True when ``bind`` reads device state to choose what ``execute`` runs."""
        return self.dynamic_context or self.greedy_shortcut

    @classmethod
    def static(cls, *, processed_logprobs: bool = False) -> ExecutionOptions:
        """Fixed work per shape: capturable (CUDA graphs)."""
        return cls(processed_logprobs=processed_logprobs)

    @classmethod
    def eager(cls, *, capture_forward: bool = False,
              processed_logprobs: bool = False) -> ExecutionOptions:
        """Work follows the frame: for backends that run ``execute`` eagerly (CPU);
        with ``capture_forward`` the forward replays captured graphs (the runtime's
        default, ``RuntimeConfig.capture_forward``)."""
        return cls(dynamic_context=True, greedy_shortcut=True,
                   capture_forward=capture_forward, processed_logprobs=processed_logprobs)

    @classmethod
    def for_device(cls, device: str, *, capture_forward: bool = False,
                   processed_logprobs: bool = False) -> ExecutionOptions:
        """The default for a torch device: static on CUDA, eager elsewhere (with the
        forward captured when ``capture_forward`` is set); ``processed_logprobs`` on
        either."""
        if torch.device(device).type == "cuda":
            return cls.static(processed_logprobs=processed_logprobs)
        return cls.eager(capture_forward=capture_forward,
                         processed_logprobs=processed_logprobs)


def context_blocks(end_position: int, *, page_size: int, blocks_per_row: int) -> int:
    """Blocks to gather so keys ``< end_position`` are covered: the covering count, at
    least one, at most ``blocks_per_row``."""
    needed = max(1, -(-max(end_position, 0) // page_size))
    return min(needed, blocks_per_row)


def covering_power_of_two(count: int, limit: int) -> int:
    """The power of two covering ``count`` (at least one), at most ``limit``: how a
    bound that is part of a graph's shape (a speculative catch-up window) is bucketed."""
    return min(1 << (max(count, 1) - 1).bit_length(), limit)


def power_of_two_buckets(limit: int) -> tuple[int, ...]:
    """Every value ``covering_power_of_two`` can return under ``limit``: the powers of
    two below it, and ``limit`` itself."""
    buckets = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return (*buckets, limit)
