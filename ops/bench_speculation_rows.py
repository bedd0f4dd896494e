"""The rows of ``flare bench speculation`` (``ops.bench_speculation``) and of its
simulated run (``ops.bench_speculation_sim``): the modes compared, one row per mode and
load, the table with the seed's verdicts under it, and the medians over ``--repeats``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ops.bench_verdicts import target_verdicts


@dataclass(frozen=True, slots=True)
class Mode:
    speculation: str
    source: str
    depth: int
    counterfactuals: bool = True
    """Adaptive copy: counterfactual copy rounds on (flare) or off (the seed's ACC-9)."""
    catch_up: int | None = None
    """Learned draft: this mode's ``--draft-catch-up`` (None: the command's flag)."""
    policy: str | None = None
    """Adaptive: this mode's policy preset (None: the command's ``--scheduler-policy``)."""

    def label(self) -> str:
        if self.speculation == "off":
            return "off"
        depth = f"d{self.depth}" if self.speculation == "fixed" else f"adaptive<=d{self.depth}"
        seed_only = "" if self.counterfactuals else ",acc9"
        lag = f",lag<={self.catch_up}" if self.catch_up else ""
        preset = f",{self.policy}" if self.policy else ""
        return f"{self.source}:{depth}{seed_only}{lag}{preset}"


@dataclass(frozen=True, slots=True)
class Row:
    mode: str
    streams: int
    tokens: int
    seconds: float
    tokens_per_s: float
    mean_itl_ms: float
    acceptance: float = 0.0
    """Accepted / drafted tokens over the measured load (0 without speculation)."""
    speculative_share: float = 0.0
    """Speculative programs / all programs run over the measured load."""
    mean_gap_ms: float = 0.0
    """Delivery cadence: per request, the time from its first to its last visible burst
    over the bursts after the first; averaged over requests. A speculative burst of
    several tokens is one delivery (what the balanced preset's delivery price values)."""
    diagnosis: str = field(default="", compare=False)
    """``--diagnose`` figures for this load (empty otherwise)."""
    repeat: int = field(default=0, compare=False)
    """Which of the ``--repeats`` interleaved runs measured this row (0-based)."""


def render(rows: list[Row]) -> str:
    loads = sorted({r.streams for r in rows})
    labels = list(dict.fromkeys(r.mode for r in rows))
    by_key = {(r.mode, r.streams): r for r in rows}
    width = max(20, *(len(label) + 2 for label in labels))
    header = f"{'mode':<{width}}" + "".join(
        f"{f'{n} stream tok/s':>18}{'ITL ms':>9}{'gap ms':>8}{'acc':>6}{'spec':>6}"
        for n in loads)
    lines = [header, "-" * len(header)]
    for label in labels:
        cells = "".join(
            f"{r.tokens_per_s:>18.1f}{r.mean_itl_ms:>9.2f}{r.mean_gap_ms:>8.2f}"
            f"{r.acceptance:>6.2f}{r.speculative_share:>6.2f}"
            for r in (by_key[(label, n)] for n in loads))
        lines.append(f"{label:<{width}}{cells}")
    verdicts = target_verdicts(rows)
    if verdicts:
        lines += ["", *verdicts]
    return "\n".join(lines)


def median_rows(rows: list[Row]) -> list[Row]:
    """One row per (mode, load): the median of every figure over the repeats."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.mode, r.streams), []).append(r)
    out = []
    for (mode, streams), group in groups.items():
        def med(field: str, group: list[Row] = group) -> float:
            return float(statistics.median(getattr(r, field) for r in group))
        out.append(Row(mode=mode, streams=streams, tokens=int(med("tokens")),
                       seconds=med("seconds"), tokens_per_s=med("tokens_per_s"),
                       mean_itl_ms=med("mean_itl_ms"), mean_gap_ms=med("mean_gap_ms"),
                       acceptance=med("acceptance"),
                       speculative_share=med("speculative_share")))
    return out
