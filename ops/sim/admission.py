"""The simulator's waiting requests, in the admission order ``SimOptions.admission``
names (``policy.admission_order``: ``fifo``, or ``least-slack`` by arrival minus the
prompt's pure prefill time on the cost table). Either order admits while fewer than
``max_resident`` requests are resident; only which waiting request goes next differs.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

from ops.sim.costs import CostTable, pure_prefill_ns
from policy.admission_order import check_admission_order, least_slack_key

T = TypeVar("T")


class AdmissionQueue(Generic[T]):
    """Waiting requests, popped in ``order``."""

    def __init__(self, order: str, costs: CostTable) -> None:
        self._least_slack = check_admission_order(order) == "least-slack"
        self._costs = costs
        self._prefill_ns: dict[int, float] = {}
        self._heap: list[tuple[float, int, T]] = []
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def append(self, item: T, *, arrival_ns: int, prompt_tokens: int) -> None:
        key = least_slack_key(arrival_ns, self._prefill(prompt_tokens)) \
            if self._least_slack else 0.0
        heapq.heappush(self._heap, (key, next(self._sequence), item))

    def pop(self) -> T:
        return heapq.heappop(self._heap)[2]

    def _prefill(self, prompt_tokens: int) -> float:
        ns = self._prefill_ns.get(prompt_tokens)
        if ns is None:
            ns = self._prefill_ns[prompt_tokens] = pure_prefill_ns(
                prompt_tokens, self._costs.mean_ns, self._costs)
        return ns
