"""``vtc``: virtual-token-counter fairness across clients, on top of chunked prefill.

The Virtual Token Counter of Sheng et al. ("Fairness in Serving Large Language Models",
OSDI 2024) on prepared shapes. Each client has a counter of the service it received:
``input_weight`` (1) per prompt token consumed plus ``output_weight`` (2) per output
token committed, charged at completion. A client that becomes backlogged (its first
resident request while it has none) has its counter lifted to the minimum counter of
the backlogged clients, so idle time banks no credit. Whenever a running slot is free,
the next request to start is the oldest one of the client with the smallest counter;
decoders claim rows in counter order when they outnumber a step's rows. Steps are
built like ``sarathi`` (same token budget, mixed piggybacking or alternation).

Bound (checked by the tests): between any two backlogged clients the counters differ by
at most ``counter_bound()`` = ``2 * running_limit * W`` where ``W`` is the largest
weighted size (``input_weight * uncached prompt + output_weight * max output``) of any
admitted request: a client is only chosen to start work while it has the smallest
counter, so it can run ahead only by what its running requests (at most
``running_limit``) consume, and a lifted client starts within the spread of the
backlogged ones.
"""

from __future__ import annotations

from collections.abc import Iterable

from policy.baselines.base import DEFAULT_CLIENT, BaselineRequest
from policy.baselines.sarathi import DEFAULT_TOKEN_BUDGET, SarathiPolicy
from policy.config import PolicyConfig
from policy.descriptors import GraphShape
from policy.types import Phase, PolicyError

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class VtcPolicy(SarathiPolicy):
    """Fair share of weighted tokens across client tags (``assign_client``)."""

    name = "vtc"

    def __init__(self, config: PolicyConfig | None = None,
                 catalog: Iterable[GraphShape] = (), *,
                 token_budget: int = DEFAULT_TOKEN_BUDGET,
                 input_weight: float = INPUT_WEIGHT,
                 output_weight: float = OUTPUT_WEIGHT) -> None:
        if not (input_weight > 0 and output_weight > 0):
            raise PolicyError("VTC weights must be positive")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self._counters: dict[str, float] = {}
        self._largest_request = 0.0
        super().__init__(config, catalog, token_budget=token_budget)

    # ---- counters -------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """Every client's virtual token counter."""
        return dict(self._counters)

    def backlogged_clients(self) -> set[str]:
        """Clients with at least one resident request that still has work."""
        return {r.client for r in self._requests.values() if _has_work(r)}

    def counter_bound(self) -> float:
        """The spread the counters of backlogged clients stay within (module doc)."""
        return 2.0 * self.running_limit * self._largest_request

    def _lift(self, client: str, exclude: BaselineRequest) -> None:
        """Lift ``client`` to the backlogged minimum if it is newly backlogged."""
        others = [r for r in self._requests.values() if r is not exclude and _has_work(r)]
        if any(r.client == client for r in others):
            return
        backlogged = {r.client for r in others}
        floor = min((self._counters.get(c, 0.0) for c in backlogged), default=None)
        current = self._counters.get(client, 0.0)
        self._counters[client] = current if floor is None else max(current, floor)

    def _on_admitted(self, req: BaselineRequest) -> None:
        size = (self.input_weight * (req.prompt_len - req.cached_prefix_len)
                + self.output_weight * req.max_output_tokens)
        self._largest_request = max(self._largest_request, size)
        self._lift(req.client, req)

    def _on_client(self, req: BaselineRequest, previous: str) -> None:
        self._lift(req.client, req)

    def _on_served(self, req: BaselineRequest, prompt_tokens: int, output_tokens: int) -> None:
        self._counters[req.client] = (self._counters.get(req.client, 0.0)
                                      + self.input_weight * prompt_tokens
                                      + self.output_weight * output_tokens)

    def _rank(self, req: BaselineRequest) -> tuple[float, int]:
        return (self._counters.get(req.client, 0.0), req.sequence)

    # ---- ordering ---------------------------------------------------------------------

    def _next_prompt(self) -> BaselineRequest | None:
        prompts = self._prompts()
        started = [r for r in prompts if r.started]
        if started:
            return min(started, key=self._rank)
        if prompts and self._may_start():
            return min(prompts, key=self._rank)
        return None

    def _ordered_decoders(self) -> list[BaselineRequest]:
        return sorted(self._decoders(), key=self._rank)


def _has_work(req: BaselineRequest) -> bool:
    return not req.cancelled and req.phase in (Phase.PREFILL, Phase.DECODE)


__all__ = ["DEFAULT_CLIENT", "INPUT_WEIGHT", "OUTPUT_WEIGHT", "VtcPolicy"]
