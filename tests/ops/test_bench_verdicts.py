"""``ops.bench_verdicts.held_out_verdicts``: the speculation target with the
best fixed choice picked on held-out repeats and compared within each repeat."""

from __future__ import annotations

from ops.bench_speculation_rows import Row
from ops.bench_verdicts import held_out_verdicts


def _rows(figures: dict[tuple[str, int], list[float]]) -> list[Row]:
    return [Row(mode, streams, 10, 1.0, v, 5.0, repeat=k)
            for (mode, streams), values in figures.items() for k, v in enumerate(values)]


def test_each_repeat_is_compared_with_the_choice_the_other_repeats_pick() -> None:
    """Repeat 0: the others' medians pick d3 (143 > 135), ratio 145/130; repeat 1:
    d2 (145 > 132.5), 140/130; repeat 2: d3 (140.5 > 140), 138/135."""
    rows = _rows({("off", 8): [100.0, 100.0, 100.0],
                  ("copy:d2", 8): [150.0, 130.0, 140.0],
                  ("copy:d3", 8): [130.0, 151.0, 135.0],
                  ("copy:adaptive<=d3", 8): [145.0, 140.0, 138.0],
                  ("copy:adaptive<=d3,acc9", 8): [10.0, 10.0, 10.0]})
    assert held_out_verdicts(rows) == [
        "copy:adaptive<=d3 @ 8: +7.7% (range +2.2% to +11.5%) against the fixed choice "
        "picked on the other repeats (copy:d2 x1, copy:d3 x2), paired over 3 repeats: met"]


def test_off_competes_and_a_lower_median_ratio_is_not_met() -> None:
    rows = _rows({("off", 1): [100.0, 104.0],
                  ("draft:d1", 1): [90.0, 95.0],
                  ("draft:adaptive<=d1", 1): [98.0, 99.0]})
    assert held_out_verdicts(rows) == [
        "draft:adaptive<=d1 @ 1: -3.4% (range -4.8% to -2.0%) against the fixed choice "
        "picked on the other repeats (off x2), paired over 2 repeats: not met"]


def test_one_repeat_gives_no_held_out_verdict() -> None:
    rows = _rows({("off", 1): [100.0], ("copy:d2", 1): [120.0],
                  ("copy:adaptive<=d2", 1): [130.0]})
    assert held_out_verdicts(rows) == []


def test_each_load_and_source_is_judged_against_its_own_fixed_choices() -> None:
    rows = _rows({("off", 1): [10.0, 10.0], ("off", 8): [50.0, 50.0],
                  ("copy:d1", 1): [20.0, 20.0], ("copy:d1", 8): [40.0, 40.0],
                  ("draft:d1", 1): [99.0, 99.0], ("draft:d1", 8): [99.0, 99.0],
                  ("copy:adaptive<=d1", 1): [22.0, 22.0],
                  ("copy:adaptive<=d1", 8): [55.0, 55.0]})
    verdicts = held_out_verdicts(rows)
    assert [v.split(":")[1] for v in verdicts] == ["adaptive<=d1 @ 1", "adaptive<=d1 @ 8"]
    assert "(copy:d1 x2)" in verdicts[0] and "+10.0%" in verdicts[0]
    assert "(off x2)" in verdicts[1] and "+10.0%" in verdicts[1]
