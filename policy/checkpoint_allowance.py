"""The checkpoint extra-work allowance: a per-request ledger of optional capture work.

Seed *Planning and the execution queue* (checkpoint retention), QUEUE-20..26:

- **The allowance** (QUEUE-20, QUEUE-21). Additional prefill splits and snapshot
  copies must fit ``checkpoint_extra_work_fraction`` (``PolicyConfig``, default 0.05)
  times the request's *estimated uncached prefill work*. ``estimated_prefill_ns``
  gives that estimate from the measured prefill shapes.
- **Unknown costs** (QUEUE-22). An unknown capture cost (0 or ``None``, DUR-2) or an
  unknown prefill estimate disables extras; the anchor itself stays eligible, which
  is the caller's business (its pages keep their checkpoint role whether or not an
  extra copy runs).
- **Terminal capture** (QUEUE-23). Productive completed decode earns the same
  fraction of its measured time, spendable only on a *distinct* terminal capture
  (one whose endpoint is not an anchor already captured, e.g. a one-token answer
  whose written state ends at the prompt end). The terminal capture may also spend
  what the prefill part left.
- **No counts, no shares** (QUEUE-24). Nothing here counts captures or looks at other
  requests: a request may capture as often as its own allowance pays for.
- **Destinations** (QUEUE-25). An extra cut is planned only with an obtainable
  snapshot destination (``plan_capture`` takes the allocator's answer).
- **Expiry** (QUEUE-26). A split that already executed keeps its charge; when its
  copy's cost has expired by the time the copy would run, the copy is skipped and
  its charge refunded (``copy_after_split``).

Arithmetic is exact (OPEN-6's habit for ledgers): integer nanoseconds and the fraction
as the ``Fraction`` of its shortest decimal form, so 100 ms of decode at 0.05 earns
exactly 5 ms.

Pure: no clocks, no I/O; the scheduler feeds it measured and estimated times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

__all__ = [
    "CheckpointAllowance",
    "PlannedCapture",
    "copy_after_split",
    "estimated_prefill_ns",
    "plan_capture",
]


def _known(cost_ns: int | None) -> bool:
    return cost_ns is not None and cost_ns > 0


def estimated_prefill_ns(uncached_tokens: int,
                         prefill_costs: Iterable[tuple[int, int]]) -> int | None:
    """Estimated work to prefill ``uncached_tokens``: the cheapest covering of them by
    chunks of one measured prefill capacity, ``min(ceil(n / C) * t)`` over the
    ``(capacity C, estimate t)`` pairs with a known estimate (``t > 0``).

    Zero tokens need no work (0). ``None`` when no prefill shape is measured: the
    work is unknown, which disables extras (QUEUE-22).
    """
    if uncached_tokens <= 0:
        return 0
    best: int | None = None
    for capacity, estimate_ns in prefill_costs:
        if capacity <= 0 or estimate_ns <= 0:
            continue
        chunks = -(-uncached_tokens // capacity)
        cost = chunks * estimate_ns
        if best is None or cost < best:
            best = cost
    return best


class CheckpointAllowance:
    """One request's allowance: what it earned, what it spent (QUEUE-20..24)."""

    __slots__ = ("_fraction", "decode_ns", "prefill_work_ns", "spent_ns")

    def __init__(self, fraction: float, *, prefill_work_ns: int | None = None) -> None:
        if not 0 <= fraction < float("inf"):
            raise ValueError(f"checkpoint_extra_work_fraction must be finite and >= 0, "
                             f"got {fraction!r}")
        self._fraction = Fraction(repr(float(fraction)))
        self.prefill_work_ns: int | None = prefill_work_ns
        """Estimated uncached prefill work; None while unknown (QUEUE-22)."""
        self.decode_ns = 0
        """Measured time of the productive decode executions this request took part in."""
        self.spent_ns = 0
        """Charges of planned extra work (splits and copies), refunds deducted."""

    @property
    def fraction(self) -> Fraction:
        return self._fraction

    # ---- earning ----------------------------------------------------------------

    def ensure_prefill_estimate(self, estimate_ns: int | None) -> None:
        """Record the prefill estimate once it is known (an admission made before any
        prefill shape was measured learns it at its first capture decision)."""
        if self.prefill_work_ns is None and estimate_ns is not None and estimate_ns >= 0:
            self.prefill_work_ns = estimate_ns

    def earn_decode(self, measured_ns: int) -> None:
        """A productive decode execution of this request completed, taking
        ``measured_ns`` (QUEUE-23). A missing interval (0, DUR-19) earns nothing."""
        if measured_ns > 0:
            self.decode_ns += measured_ns

    # ---- room -------------------------------------------------------------------

    def _prefill_part(self) -> Fraction | None:
        if self.prefill_work_ns is None:
            return None
        return self._fraction * self.prefill_work_ns

    def extra_room_ns(self) -> Fraction | None:
        """What anchor splits and copies may still spend; None while the prefill
        estimate is unknown (QUEUE-20, QUEUE-22)."""
        part = self._prefill_part()
        return None if part is None else part - self.spent_ns

    def terminal_room_ns(self, *, distinct: bool) -> Fraction:
        """What a terminal capture may still spend: the prefill part's remainder (0
        while unknown) plus, for a distinct terminal endpoint, the decode part
        (QUEUE-23)."""
        room = (self._prefill_part() or Fraction(0)) - self.spent_ns
        if distinct:
            room += self._fraction * self.decode_ns
        return room

    # ---- decisions ----------------------------------------------------------------

    def allows_extra(self, cost_ns: int | None) -> bool:
        """Whether an extra split or copy costing ``cost_ns`` fits (QUEUE-20, QUEUE-22)."""
        room = self.extra_room_ns()
        if cost_ns is None or cost_ns <= 0 or room is None:
            return False
        return cost_ns <= room

    def allows_terminal(self, cost_ns: int | None, *, distinct: bool) -> bool:
        """Whether a terminal capture costing ``cost_ns`` fits (QUEUE-22, QUEUE-23)."""
        if cost_ns is None or cost_ns <= 0:
            return False
        return cost_ns <= self.terminal_room_ns(distinct=distinct)

    def charge(self, cost_ns: int) -> None:
        """Spend ``cost_ns`` on planned extra work."""
        if cost_ns < 0:
            raise ValueError(f"a charge must be non-negative, got {cost_ns}")
        self.spent_ns += cost_ns

    def refund(self, cost_ns: int) -> None:
        """Give back the charge of planned work that will not run (QUEUE-26)."""
        if not 0 <= cost_ns <= self.spent_ns:
            raise ValueError(f"cannot refund {cost_ns} ns of {self.spent_ns} ns spent")
        self.spent_ns -= cost_ns

    def take_terminal(self, cost_ns: int | None, *, distinct: bool) -> bool:
        """Decide and charge a terminal capture in one step: True when it fits."""
        if cost_ns is None or not self.allows_terminal(cost_ns, distinct=distinct):
            return False
        self.charge(cost_ns)
        return True


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedCapture:
    """An anchor capture charged to a request: an extra prefill cut and its copy."""

    split_ns: int
    """The extra cut's cost (0 when the anchor already ends a chunk)."""
    copy_ns: int


def plan_capture(allowance: CheckpointAllowance, *, split_ns: int | None, copy_ns: int | None,
                 destination_obtainable: bool) -> PlannedCapture | None:
    """Plan and charge an anchor capture, or None (nothing charged).

    Refused without an obtainable snapshot destination (QUEUE-25), with an unknown
    split or copy cost (QUEUE-22; a split of 0 means no extra cut is needed), or when
    both together do not fit the extra room (QUEUE-20).
    """
    if not destination_obtainable or copy_ns is None or copy_ns <= 0:
        return None
    if split_ns is None or split_ns < 0:
        return None
    total = split_ns + copy_ns
    if not allowance.allows_extra(total):
        return None
    allowance.charge(total)
    return PlannedCapture(split_ns=split_ns, copy_ns=copy_ns)


def copy_after_split(allowance: CheckpointAllowance, planned: PlannedCapture, *,
                     current_copy_ns: int | None) -> bool:
    """Whether the copy of ``planned`` still runs once its split has executed.

    ``current_copy_ns`` is the copy's cost now; ``None`` or 0 means it expired (stale
    or unknown). Then the copy is skipped without error and its charge refunded; the
    split's charge stays, since it ran (QUEUE-26).
    """
    if _known(current_copy_ns):
        return True
    allowance.refund(planned.copy_ns)
    return False
