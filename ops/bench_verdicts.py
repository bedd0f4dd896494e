"""The speculation target, read from ``flare bench speculation`` rows.

Target: adaptive is at least as good as the best fixed choice (``off`` included) at
every load, and strictly better than ``off`` at one stream.

Two readings are printed under the table:

- ``target_verdicts``: adaptive's median against the largest fixed median of the same
  run. Picking the largest of several noisy figures favours the fixed side: when two
  or three depths are equally good, their maximum sits above each one's true rate by
  about the noise, so adaptive at the same true rate "loses" more often than not (the
  winner's curse).
- ``held_out_verdicts`` (two or more repeats): for each repeat, the best fixed choice is
  picked on the *other* repeats' medians, and adaptive is compared with that choice in
  the same repeat (the modes of one repeat run minutes apart, so the machine's drift
  mostly cancels). The median of these paired ratios estimates adaptive against the
  best fixed choice without the selection bias.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Protocol


class BenchRow(Protocol):
    """What a verdict reads of a bench row (``ops.bench_speculation.Row``)."""

    mode: str
    streams: int
    tokens_per_s: float
    repeat: int


def _fixed_choices(mode: str, modes: Sequence[str]) -> list[str]:
    """The fixed choices an adaptive ``mode`` competes with: ``off`` and every fixed
    depth of its source."""
    source = mode.partition(":")[0]
    return [m for m in modes if m == "off" or m.startswith(f"{source}:d")]


def _adaptive_modes(modes: Sequence[str]) -> list[str]:
    """Adaptive modes that are candidates for the target (the seed-only ``,acc9``
    variant is a comparison, not a candidate)."""
    return [m for m in modes
            if m.partition(":")[2].startswith("adaptive") and not m.endswith(",acc9")]


def target_verdicts(rows: Sequence[BenchRow]) -> list[str]:
    """The target per adaptive mode and load from the rows shown (medians): adaptive
    against the best fixed choice, and against ``off`` at one stream."""
    by_key = {(r.mode, r.streams): r.tokens_per_s for r in rows}
    out = []
    for mode, streams in by_key:
        if mode not in _adaptive_modes([mode]):
            continue
        fixed = {m: by_key[m, streams]
                 for m in _fixed_choices(mode, [m for m, n in by_key if n == streams])}
        if not fixed:
            continue
        best = max(fixed, key=lambda m: fixed[m])
        adaptive = by_key[(mode, streams)]
        ratio = adaptive / fixed[best] - 1.0 if fixed[best] > 0 else 0.0
        line = (f"{mode} @ {streams}: {ratio:+.1%} against the best fixed choice "
                f"({best} {fixed[best]:.1f}): {'met' if ratio >= 0 else 'not met'}")
        if streams == 1 and "off" in fixed:
            line += f"; {'above' if adaptive > fixed['off'] else 'not above'} off"
        out.append(line)
    return out


def held_out_verdicts(rows: Sequence[BenchRow]) -> list[str]:
    """The target per adaptive mode and load with the best fixed choice picked on held-out
    repeats (module docstring); empty with fewer than two repeats.

    For repeat ``r``: ``best`` = the fixed choice with the largest median tok/s over the
    repeats other than ``r``; the paired ratio is adaptive's tok/s in ``r`` over
    ``best``'s in ``r``, minus one. The line gives the median ratio, its range, and
    which choices were picked; "met" when the median ratio is at least zero.
    """
    cells: dict[tuple[str, int], dict[int, float]] = {}
    for r in rows:
        cells.setdefault((r.mode, r.streams), {})[r.repeat] = r.tokens_per_s
    modes = list(dict.fromkeys(m for m, _ in cells))
    loads = sorted({n for _, n in cells})
    out = []
    for mode in _adaptive_modes(modes):
        for streams in loads:
            adaptive = cells.get((mode, streams), {})
            fixed = {m: cells[m, streams] for m in _fixed_choices(mode, modes)
                     if (m, streams) in cells}
            repeats = sorted(r for r in adaptive if all(r in v for v in fixed.values()))
            if len(repeats) < 2 or not fixed:
                continue
            ratios: list[float] = []
            picked: dict[str, int] = {}
            for r in repeats:
                others = [q for q in repeats if q != r]
                best = max(fixed, key=lambda m: statistics.median(fixed[m][q] for q in others))
                picked[best] = picked.get(best, 0) + 1
                if fixed[best][r] > 0:
                    ratios.append(adaptive[r] / fixed[best][r] - 1.0)
            if not ratios:
                continue
            median = statistics.median(ratios)
            picks = ", ".join(f"{m} x{k}" for m, k in sorted(picked.items()))
            out.append(
                f"{mode} @ {streams}: {median:+.1%} (range {min(ratios):+.1%} to "
                f"{max(ratios):+.1%}) against the fixed choice picked on the other "
                f"repeats ({picks}), paired over {len(ratios)} repeats: "
                f"{'met' if median >= 0 else 'not met'}")
    return out
