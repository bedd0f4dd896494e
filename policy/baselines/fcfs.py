"""``fcfs``: continuous batching in arrival order, prefill first, whole prompts.

The classic default of conventional servers (vLLM's original scheduler): requests start
in admission order while running slots remain (at most the largest decode batch run at
once, like ``max_num_seqs``); any started prompt is prefilled to its end before anything
else runs, in chunks of the largest prepared prefill capacity and a last chunk on the
smallest capacity that holds the rest (so no more capacity is used than whole prompts
need); otherwise every decoding request advances one token on the smallest decode
bucket that holds them, oldest first. Mixed programs are never used.

Seed comparison: this is the "prefill first" behaviour the seed's value-rate selection
is meant to beat on decode cadence (long prompts stall every stream behind them).
"""

from __future__ import annotations

from policy.baselines.base import BaselinePolicy
from policy.types import ScheduledStep


class FcfsPolicy(BaselinePolicy):
    """First come, first served; whole prompts before any decode."""

    name = "fcfs"

    def _choose(self) -> ScheduledStep | None:
        menu = self._menu
        prompts = self._prompts()
        started = [r for r in prompts if r.started]
        # Whole prompts: a started prompt runs to its end before anything else.
        candidate = started[0] if started else (
            prompts[0] if prompts and self._may_start() else None)
        if candidate is not None:
            tokens = min(candidate.chunk_limit(), menu.max_prefill)
            return menu.prefill_step(candidate.prompt_work(tokens))
        decoders = self._decoders()
        if decoders:
            return menu.decode_step([(r.handle, r.epoch) for r in decoders])
        return None
