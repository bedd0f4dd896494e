"""``sarathi``: chunked prefill under a fixed token budget with decodes piggybacked.

Sarathi-Serve's stall-free batching on prepared shapes. Every step carries every
running decoder (one token each) and, when a prompt is in progress or a running slot is
free, one prompt chunk of at most ``budget - decoders`` tokens; the chunk is cut to the
largest prepared prompt capacity within that room (or the whole rest of the prompt when
it is smaller), so neither the step's logical tokens nor the prompt capacity it runs
on ever exceed the budget. Prompts start in admission order; a started prompt is
continued before a new one begins.

On catalogs with ordinary mixed programs the prompt row and the decoders share one
mixed step (the smallest mixed bucket with enough rows, MIX-18); without them the policy
alternates a budget-limited prefill step and a decode step so decodes never wait for
more than one chunk. The budget must admit the smallest prompt capacity next to a full
decode batch (else no prompt could ever be piggybacked).
"""

from __future__ import annotations

from collections.abc import Iterable

from policy.baselines.base import BaselinePolicy, BaselineRequest
from policy.baselines.menu import ShapeMenu, largest_at_most
from policy.config import PolicyConfig
from policy.descriptors import GraphShape
from policy.types import PolicyError, RequestHandle, ScheduledStep

DEFAULT_TOKEN_BUDGET = 512
"""Sarathi-Serve's smaller published budget; large enough for a 256-token chunk plus a
full decode batch on the default catalog."""


class SarathiPolicy(BaselinePolicy):
    """Chunked prefill with piggybacked decodes under ``token_budget`` tokens per step."""

    name = "sarathi"

    def __init__(self, config: PolicyConfig | None = None,
                 catalog: Iterable[GraphShape] = (), *,
                 token_budget: int = DEFAULT_TOKEN_BUDGET) -> None:
        if token_budget < 1:
            raise PolicyError("token budget must be positive")
        self.token_budget = token_budget
        super().__init__(config, catalog)

    def _check_catalog(self, menu: ShapeMenu) -> None:
        if not menu.shapes:
            return
        smallest = menu.prefill[0].token_capacity
        decode_rows = menu.max_decode_batch - 1 if menu.has_mixed else 0
        if self.token_budget < smallest + decode_rows:
            raise PolicyError(
                f"token budget {self.token_budget} is below the smallest prompt capacity "
                f"{smallest} plus {decode_rows} piggybacked decode rows")

    def _next_prompt(self) -> BaselineRequest | None:
        """The prompt to advance: a started one first, else the oldest if a slot is free."""
        prompts = self._prompts()
        started = [r for r in prompts if r.started]
        if started:
            return started[0]
        return prompts[0] if prompts and self._may_start() else None

    def _choose(self) -> ScheduledStep | None:
        menu = self._menu
        decoders = [(r.handle, r.epoch) for r in self._ordered_decoders()]
        prompt = self._next_prompt()
        if prompt is not None and decoders and menu.has_mixed:
            step = self._mixed(prompt, decoders)
            if step is not None:
                return step
        if prompt is not None and not (decoders and self._last_step_had_prompt):
            room = largest_at_most(menu.prefill_capacities(), self.token_budget)
            tokens = min(prompt.chunk_limit(), room)
            return menu.prefill_step(prompt.prompt_work(tokens))
        if decoders:
            return menu.decode_step(decoders)
        return None

    def _ordered_decoders(self) -> list[BaselineRequest]:
        """Decoders in the order they claim rows (admission order here)."""
        return self._decoders()

    def _mixed(self, prompt: BaselineRequest,
               decoders: list[tuple[RequestHandle, int]]) -> ScheduledStep | None:
        menu = self._menu
        top = max(menu.mixed)
        riders = decoders[: top - 1]
        batch = menu.mixed_batch_for(len(riders) + 1)
        if batch is None:
            return None
        capacities = [s.prefill_capacity for s in menu.mixed[batch]]
        room = largest_at_most(capacities, self.token_budget - len(riders))
        if room == 0:
            return None
        tokens = min(prompt.chunk_limit(), room)
        return menu.mixed_step(batch, prompt.prompt_work(tokens), riders)
