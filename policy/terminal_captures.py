"""``TerminalCaptures``: retirement, terminal captures and the allowances that pay them.

A terminal capture (a snapshot frame before retirement, PRE-41) is extra work that a
request pays for from its checkpoint allowance (``policy.checkpoint_allowance``,
QUEUE-20..24): a fraction of its estimated uncached prefill work, and of the decode
work it ran. This module keeps one allowance per resident request and decides, at
retirement, whether the narrowest snapshot program's estimate fits (``retire``);
``preempt`` retires a request before its response completed (PRE-43).
"""

from __future__ import annotations

from collections.abc import Iterable

from policy.catalog_index import CatalogIndex
from policy.checkpoint_allowance import CheckpointAllowance, estimated_prefill_ns
from policy.duration_estimates import DurationEstimates
from policy.requests import RequestRecord
from policy.types import Phase, RequestHandle, RestoreNeed

__all__ = ["TerminalCaptures", "prefill_work_ns"]


def prefill_work_ns(uncached_tokens: int, catalog: CatalogIndex,
                    estimates: DurationEstimates) -> int | None:
    """Estimated work to prefill ``uncached_tokens`` on the measured prefill shapes
    (QUEUE-20's "estimated uncached prefill work"); None while none is measured."""
    shapes = catalog.shapes
    return estimated_prefill_ns(uncached_tokens, (
        (shapes[int(i)].token_capacity, estimates.estimate_ns(shapes[int(i)]))
        for i in catalog.prefill))


class TerminalCaptures:
    """One ``CheckpointAllowance`` per resident request, and retirement by it."""

    def __init__(self) -> None:
        self._by_handle: dict[RequestHandle, CheckpointAllowance] = {}

    def admit(self, handle: RequestHandle, fraction: float, *, uncached_tokens: int,
              catalog: CatalogIndex, estimates: DurationEstimates) -> None:
        self._by_handle[handle] = CheckpointAllowance(
            fraction, prefill_work_ns=prefill_work_ns(uncached_tokens, catalog, estimates))

    def release(self, handles: Iterable[RequestHandle]) -> None:
        for h in handles:
            self._by_handle.pop(h, None)

    def get(self, handle: RequestHandle) -> CheckpointAllowance | None:
        return self._by_handle.get(handle)

    def __getitem__(self, handle: RequestHandle) -> CheckpointAllowance:
        return self._by_handle[handle]

    def take_terminal_capture(self, rec: RequestRecord, catalog: CatalogIndex,
                              estimates: DurationEstimates) -> bool:
        """Charge a terminal capture to ``rec``'s allowance if it fits: the narrowest
        snapshot shape's estimate against the prefill part and, for a terminal
        endpoint distinct from the prompt end (more than one output), the decode
        part. An unknown snapshot cost disables it (QUEUE-22)."""
        allowance = self._by_handle.get(rec.handle)
        if allowance is None:
            return False
        allowance.ensure_prefill_estimate(
            prefill_work_ns(rec.prompt_len - rec.cached_prefix_len, catalog, estimates))
        narrowest = catalog.shapes[int(catalog.snapshot[0])]
        cost = estimates.estimate_ns(narrowest)
        return allowance.take_terminal(cost or None, distinct=rec.output_committed > 1)

    def retire(self, rec: RequestRecord, catalog: CatalogIndex, estimates: DurationEstimates,
               now_ns: int, *, mandatory: bool = False) -> None:
        """Terminal snapshot pending (PRE-41) when the catalog has one and either the
        retirement is mandatory (preemption) or the request's checkpoint allowance
        pays for the capture (QUEUE-20..23); else retired at once, and the runtime
        publishes the request's checkpoint without a capture."""
        if len(catalog.snapshot) and (
                mandatory or self.take_terminal_capture(rec, catalog, estimates)):
            rec.phase = Phase.TERMINAL
            rec.terminal_since_ns = now_ns
        else:
            rec.phase = Phase.RETIRED

    def preempt(self, rec: RequestRecord, catalog: CatalogIndex,
                estimates: DurationEstimates, now_ns: int) -> None:
        """Begin retiring ``rec`` without completing its response (PRE-43); its terminal
        age starts now (PRE-41)."""
        if rec.phase in (Phase.RETIRED, Phase.TERMINAL) or rec.cancelled:
            return
        rec.preempted = True
        if rec.restore is not RestoreNeed.NONE:
            if not rec.restored:
                rec.phase = Phase.RETIRED  # its state is not resident: nothing to snapshot
                return
            rec.restore, rec.further_stages = RestoreNeed.NONE, ()
        self.retire(rec, catalog, estimates, now_ns, mandatory=True)
