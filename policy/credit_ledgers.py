"""Exploration credit ledgers: funded timing refresh and funded acceptance learning.

Seed sections: *Funded timing refresh* (REF-1..6, REF-16..20) and the ledger parts of
*Funded acceptance learning* (LRN-1, LRN-2, LRN-11, LRN-14..17, LRN-20); seed module
``refresh.rs``. Which candidate an episode runs is ``policy/selection.py``'s business;
this module only keeps the books.

Arithmetic is exact (OPEN-6): ordinary work earns ``numerator/denominator`` of its
credited duration, and the balance is kept as an integer count of
``1/denominator`` ns (exposed as a ``fractions.Fraction`` of ns), so no rounding ever
accumulates. The cap is on the balance: full credit is 5 ms. So 2,494 ms of ordinary work does not fund the first
refresh and 2,495 ms does (REF-19: ``2/998 * 2,495 ms = 5 ms``); for acceptance learning
full credit is first reached at 495 ms (``1/99``, LRN-2).

Rules:

- ``earn`` adds the share and clamps the balance to full credit (REF-1, REF-2, LRN-1);
  debt is repaid by later earnings.
- An episode may begin only when the balance is at full credit and no episode is open
  (REF-16, LRN-15); ``charge`` debits its actual raw duration, which may drive the
  balance negative (REF-17, LRN-14).
- ``on_idle`` discards positive credit and keeps debt (REF-6, LRN-16, OPEN-8).
- Initial discovery earns nothing (REF-5, LRN-18): the scheduler simply does not call
  ``earn`` for discovery runs, nor ``charge``.

Invariant (REF-18, LRN-17): with O the total credited ordinary duration, P the total
charged episode duration and D the actual duration of the current or last episode,
``P <= numerator/denominator * O + D``. ``bound_holds()`` checks it exactly.
"""

from __future__ import annotations

from fractions import Fraction

from policy.descriptors import ExecutionTiming

__all__ = [
    "FULL_CREDIT_NS",
    "CreditLedger",
    "LedgerError",
    "acceptance_learning_ledger",
    "credited_duration_ns",
    "episode_charge_ns",
    "settle_frame",
    "timing_refresh_ledger",
]

FULL_CREDIT_NS = 5_000_000
"""Both ledgers cap their balance at 5 ms, which is also full credit (OPEN-6)."""


class LedgerError(RuntimeError):
    """Raised when an episode is begun, charged or ended out of order."""


class CreditLedger:
    """One exploration budget: earns a share of ordinary time, pays for episodes."""

    def __init__(
        self, share_numerator: int, share_denominator: int, full_credit_ns: int = FULL_CREDIT_NS
    ) -> None:
        if share_numerator < 0 or share_denominator <= 0:
            raise ValueError("the credit share must be a non-negative fraction")
        if full_credit_ns <= 0:
            raise ValueError("full credit must be positive")
        self._numerator = share_numerator
        self._denominator = share_denominator
        # Balance and cap in units of 1/denominator ns: exact integer arithmetic.
        self._full_scaled = full_credit_ns * share_denominator
        self._balance_scaled = 0
        self._episode_open = False
        self._ordinary_ns = 0
        self._episodes_ns = 0
        self._current_or_last_episode_ns = 0

    @property
    def share(self) -> Fraction:
        """The fraction of credited ordinary time this ledger earns."""
        return Fraction(self._numerator, self._denominator)

    @property
    def full_credit_ns(self) -> Fraction:
        """The cap on the balance, and the balance an episode needs (5 ms)."""
        return Fraction(self._full_scaled, self._denominator)

    @property
    def balance_ns(self) -> Fraction:
        """Exact current credit in ns; negative while an episode's overrun is unpaid."""
        return Fraction(self._balance_scaled, self._denominator)

    @property
    def episode_open(self) -> bool:
        """True between ``begin_episode`` and ``end_episode``."""
        return self._episode_open

    @property
    def ordinary_ns(self) -> int:
        """O: total credited ordinary duration ever passed to ``earn``."""
        return self._ordinary_ns

    @property
    def episodes_ns(self) -> int:
        """P: total duration ever charged to episodes."""
        return self._episodes_ns

    @property
    def current_or_last_episode_ns(self) -> int:
        """D: the actual duration charged to the current or the last episode."""
        return self._current_or_last_episode_ns

    def earn(self, ordinary_ns: int) -> None:
        """Credit ``share * ordinary_ns``, capping the balance at full credit (REF-1, REF-2)."""
        if ordinary_ns < 0:
            raise ValueError(f"credited duration must be non-negative, got {ordinary_ns}")
        self._ordinary_ns += ordinary_ns
        self._balance_scaled = min(
            self._balance_scaled + self._numerator * ordinary_ns, self._full_scaled
        )

    def funded(self) -> bool:
        """Full credit and no episode open: another episode may begin (REF-16, LRN-15)."""
        return not self._episode_open and self._balance_scaled >= self._full_scaled

    def begin_episode(self) -> None:
        """Open an episode; only one at a time and only when funded."""
        if self._episode_open:
            raise LedgerError("an episode is already open")
        if self._balance_scaled < self._full_scaled:
            balance = self._balance_scaled / self._denominator
            raise LedgerError(f"episode not funded: balance {balance:.0f} ns")
        self._episode_open = True
        self._current_or_last_episode_ns = 0

    def charge(self, ns: int) -> None:
        """Debit ``ns`` of the open episode's actual raw duration (REF-14, LRN-11).

        The balance may go negative: a started episode is never preempted (LRN-14).
        """
        if not self._episode_open:
            raise LedgerError("charge outside an episode")
        if ns < 0:
            raise ValueError(f"episode duration must be non-negative, got {ns}")
        self._balance_scaled -= ns * self._denominator
        self._episodes_ns += ns
        self._current_or_last_episode_ns += ns

    def end_episode(self) -> None:
        """Close the open episode; the next needs full credit again (REF-16)."""
        if not self._episode_open:
            raise LedgerError("no episode is open")
        self._episode_open = False

    def on_idle(self) -> None:
        """Idle discards positive credit and preserves debt (REF-6, LRN-16, OPEN-8)."""
        if self._balance_scaled > 0:
            self._balance_scaled = 0

    def bound_holds(self) -> bool:
        """REF-18 / LRN-17: ``P <= share * O + D``, exactly."""
        slack = self._current_or_last_episode_ns * self._denominator
        return (
            self._episodes_ns * self._denominator
            <= self._numerator * self._ordinary_ns + slack
        )


def timing_refresh_ledger() -> CreditLedger:
    """The 0.002/0.998 timing-refresh ledger (REF-1)."""
    return CreditLedger(2, 998)


def acceptance_learning_ledger() -> CreditLedger:
    """The 0.01/0.99 acceptance-learning ledger (LRN-1)."""
    return CreditLedger(1, 99)


def credited_duration_ns(timing: ExecutionTiming, *, isolated: bool) -> int:
    """Credited time of an ordinary valid completion (REF-3, REF-4, OPEN-7).

    Queued: the maximum positive device interval; isolated: the larger of that and wall
    time. Raw, not readiness-corrected (LRN-20). 0 without a valid device interval: an
    invalid completion earns nothing.
    """
    device = timing.device_ns
    if device <= 0:
        return 0
    return max(device, timing.wall_ns) if isolated else device


def episode_charge_ns(timing: ExecutionTiming, *, isolated: bool = True) -> int:
    """What one exploration execution costs its ledger (REF-11, REF-14, LRN-11).

    With a valid device interval: the raw interval (readiness stalls included), or for an
    isolated execution the larger of that and wall time. Without one, the attempt is paid
    with its wall time (REF-11).
    """
    device = timing.device_ns
    if device <= 0:
        return max(timing.wall_ns, 0)
    return max(device, timing.wall_ns) if isolated else device


def settle_frame(ledger: CreditLedger, timing: ExecutionTiming, *, isolated: bool,
                 ordinary: bool, episode: bool) -> None:
    """A completed frame in ``ledger``: ordinary work earns its credited duration
    (REF-1, LRN-1); the ledger's own episode is charged its raw duration and closed
    (REF-11, REF-17, LRN-11, LRN-14); anything else (discovery, the other ledger's
    episodes) leaves it alone (REF-5, LRN-18)."""
    if ordinary:
        ledger.earn(credited_duration_ns(timing, isolated=isolated))
    elif episode:
        ledger.charge(episode_charge_ns(timing, isolated=isolated))
        ledger.end_episode()
