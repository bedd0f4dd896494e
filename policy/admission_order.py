"""Which waiting request becomes resident next: the admission order.

- ``fifo`` (the default): in arrival order.
- ``least-slack``: the waiting request whose latest start comes first, if every request
  has the same TTFT target ``D``. A request started now meets it when
  ``now + prefill <= arrival + D``, so its latest start is ``arrival + D - prefill``,
  and ``D`` drops out of the order: ``least_slack_key`` is ``arrival - prefill``, with
  ``prefill`` the prompt's pure prefill time (``pure_prefill_ns``). A long prompt that
  arrives behind short ones goes first unless they arrived more than its extra prefill
  time before it; equal keys stay first come, first served.

The order only chooses among waiting requests: how many are resident at once is the
runtime's row and page grant. The server (``actors.admission``) and the simulator
(``ops.sim.admission``) both order by this key; the seed says nothing about admission
order, so ``fifo`` is the seed's behaviour and ``least-slack`` flare's option.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

ADMISSION_ORDERS = ("fifo", "least-slack")


def check_admission_order(order: str) -> str:
    """``order`` if it is one of ``ADMISSION_ORDERS`` (``ValueError`` otherwise)."""
    if order not in ADMISSION_ORDERS:
        raise ValueError(f"admission order must be one of {', '.join(ADMISSION_ORDERS)}, "
                         f"got {order!r}")
    return order


def pure_prefill_ns(prompt_tokens: int, chunk_times: Iterable[tuple[int, float]]) -> float:
    """The fastest prefill of ``prompt_tokens`` alone with one prefill program:
    ``min over C of ceil(L / C) * T(C)`` over ``(C, T(C))`` pairs (chunk capacity, ns).
    ``ValueError`` when there is no pair."""
    best = math.inf
    for capacity, ns in chunk_times:
        if capacity > 0:
            best = min(best, math.ceil(prompt_tokens / capacity) * ns)
    if not math.isfinite(best):
        raise ValueError("the catalog has no prefill shape")
    return best


def least_slack_key(arrived_ns: int, prefill_ns: float) -> float:
    """The least-slack order's key: smaller goes first (module docstring)."""
    return arrived_ns - prefill_ns
