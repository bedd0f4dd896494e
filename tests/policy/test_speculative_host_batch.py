"""The host search's list path equals the numpy batch it replaced (``policy/rounds.py``).

``_host_batch`` prices every host-allocated program's top-``B`` cohort at complete
ceilings (SEL-25) and hands programs whose ``P`` binds to the exact search (SEL-27). It
ran as one numpy pass; on decisions of at most eight lanes Python lists are several
times cheaper. The reference below is that numpy pass verbatim (HEAD before the
change), so any divergence in cohort, rows, value, slope or rate -- to the bit -- or in
ranking fails here. Covers SEL-19, SEL-24, SEL-25, SEL-27, DUR-24.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from policy.descriptors import GraphKind, GraphShape, TargetBinding
from policy.round_cohorts import _HostPick
from policy.round_table import LaneTable, Ordering, RoundCandidate, SpeculativeLane, lane_width
from policy.rounds import (
    RoundPrograms,
    SpeculationMode,
    _host_batch,
    _host_candidates,
    _host_picks,
    rank_key,
    round_candidates,
)
from policy.types import RequestHandle
from policy.utility import NS_PER_MS, value_rates


def reference_host_batch(shapes: Sequence[GraphShape], estimates: Sequence[int],
                         table: LaneTable, waiting: float,
                         mode: SpeculationMode) -> list[RoundCandidate]:
    """The numpy implementation the list path replaced (kept here as the oracle)."""
    n = len(table.lanes)
    if not shapes or n == 0:
        return []
    widths = np.array([lane_width(sh) for sh in shapes], dtype=np.int64)
    ceil = np.minimum(table.limit[None, :], widths[:, None])
    if ceil.min() <= 0:
        out: list[RoundCandidate] = []
        for shape, estimate in zip(shapes, estimates, strict=True):
            out.extend(_host_candidates(shape, table, estimate, waiting, mode))
        return out
    est = np.array(estimates, dtype=np.int64)
    t_ms = est / NS_PER_MS
    at = table.base[table.index[None, :], ceil]
    order = np.argsort(-(at + table.slope[None, :] * t_ms[:, None]), axis=1, kind="stable")
    sorted_ceil = np.take_along_axis(ceil, order, axis=1)
    last = np.minimum(np.array([sh.batch_capacity for sh in shapes], dtype=np.int64), n) - 1
    picks = np.arange(len(shapes))
    rows_used = np.cumsum(sorted_ceil, axis=1)[picks, last]
    base = np.cumsum(np.take_along_axis(at, order, axis=1), axis=1)[picks, last]
    slope = np.cumsum(table.slope[order], axis=1)[picks, last]
    rates = value_rates(base, slope, t_ms, waiting)
    fits = rows_used <= np.array([sh.packed_capacity for sh in shapes], dtype=np.int64)
    out = []
    for k, shape in enumerate(shapes):
        estimate = int(est[k])
        if not fits[k]:
            out.extend(_host_candidates(shape, table, estimate, waiting, mode))
            continue
        m = int(last[k]) + 1
        rows = sorted_ceil[k, :m]
        out.append(RoundCandidate(
            shape=shape, base=float(base[k]), slope=float(slope[k]), estimate_ns=estimate,
            rate=float(rates[k]) if estimate > 0 else None, ordering=Ordering.HOST,
            table=table, lane_index=order[k, :m], rows=rows, ceilings=rows,
            rows_used=int(rows_used[k])))
    return out


def catalog(rng: random.Random) -> list[GraphShape]:
    """The default adaptive catalog's host programs (B 1..8, D 0..4) plus ragged ones
    whose ``P`` binds."""
    shapes = [GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=d + 1,
                         proposal_depth=d, packed_capacity=b * (d + 1),
                         binding=TargetBinding.QUERY_LENGTH)
              for b in (1, 2, 4, 8) for d in range(5)]
    for _ in range(4):
        b, d = rng.choice((2, 4, 8)), rng.randint(1, 4)
        shapes.append(GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=b,
                                 token_capacity=d + 1, proposal_depth=d,
                                 packed_capacity=rng.randint(b, b * (d + 1) - 1),
                                 binding=TargetBinding.QUERY_LENGTH))
    return shapes


def lanes(rng: random.Random, n: int, *, ties: bool) -> list[SpeculativeLane]:
    out = []
    for i in range(n):
        survival = tuple(sorted((rng.random() for _ in range(4)), reverse=True))
        value = 1.0 if ties else rng.uniform(0.2, 3.0)
        out.append(SpeculativeLane(
            handle=RequestHandle(i + 1), epoch=0, token_value=value,
            delivery_value=0.5 if ties else rng.uniform(0.0, 2.0),
            age_value=0.0 if ties else rng.uniform(0.0, 5.0),
            age_slope=0.01 if ties else rng.uniform(0.0, 0.2),
            output_limit=rng.choice((1, 2, 3, 50)) if not ties else 50,
            context_limit=500, survival=survival))
    return out


def same(a: RoundCandidate, b: RoundCandidate) -> None:
    assert a.shape == b.shape and a.ordering is b.ordering
    assert a.lane_index.tolist() == b.lane_index.tolist()
    assert a.rows.tolist() == b.rows.tolist() and a.ceilings.tolist() == b.ceilings.tolist()
    assert (a.base, a.slope, a.rate, a.estimate_ns, a.rows_used) == \
        (b.base, b.slope, b.rate, b.estimate_ns, b.rows_used)
    assert rank_key(a) == rank_key(b)


@pytest.mark.parametrize("seed", range(40))
def test_sel_25_27_list_path_equals_numpy_batch_to_the_bit(seed: int) -> None:
    rng = random.Random(seed)
    shapes = catalog(rng)
    n = rng.randint(1, 8)
    table = LaneTable(lanes(rng, n, ties=seed % 4 == 0), max(lane_width(s) for s in shapes),
                       alpha=rng.choice((0.5, 1.0, 2.0)), optimistic=False)
    estimates = [0 if rng.random() < 0.2 else rng.randint(3, 40) * 1_000_000 + rng.randint(0, 999)
                 for _ in shapes]
    waiting = rng.uniform(0.0, 0.3)
    for mode in SpeculationMode:
        got = _host_batch(shapes, estimates, table, waiting, mode)
        want = reference_host_batch(shapes, estimates, table, waiting, mode)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            same(a, b)


@pytest.mark.parametrize("seed", range(10))
def test_dur_24_pick_rank_equals_rank_key_of_its_candidate(seed: int) -> None:
    """A pick ranks (DUR-22..24) exactly as the candidate it becomes, so sorting picks
    before building them keeps the order."""
    rng = random.Random(100 + seed)
    shapes = catalog(rng)
    table = LaneTable(lanes(rng, rng.randint(1, 8), ties=seed % 2 == 0), 5, alpha=1.0,
                       optimistic=False)
    estimates = [0 if rng.random() < 0.3 else rng.randint(3, 40) * 1_000_000 for _ in shapes]
    picks = _host_picks(shapes, estimates, table, 0.05, SpeculationMode.ADAPTIVE)
    built = [p for p in picks if isinstance(p, _HostPick)]
    assert built
    for p in built:
        assert p.rank() == rank_key(p.candidate(table))


def test_sel_25_lane_without_room_takes_the_per_program_path() -> None:
    """A lane at its output limit (ceiling 0) never joins a cohort (SEL-25)."""
    rng = random.Random(7)
    shapes = catalog(rng)
    live = lanes(rng, 3, ties=True)
    full = live[1]._replace(output_limit=0)
    table = LaneTable([live[0], full, live[2]], 5, alpha=1.0, optimistic=False)
    got = _host_batch(shapes, [5_000_000] * len(shapes), table, 0.1, SpeculationMode.ADAPTIVE)
    assert got and all(1 not in c.lane_index.tolist() for c in got)
    want = reference_host_batch(shapes, [5_000_000] * len(shapes), table, 0.1,
                                SpeculationMode.ADAPTIVE)
    for a, b in zip(got, want, strict=True):
        same(a, b)


def test_sel_24_ranked_candidates_unchanged() -> None:
    """The full ranking (dominance filter included) over the list path picks the same
    best round as a brute-force per-program search (SEL-24, SEL-32)."""
    rng = random.Random(3)
    shapes = catalog(rng)
    spec_lanes = lanes(rng, 6, ties=False)
    estimates = {s: rng.randint(5, 30) * 1_000_000 for s in shapes}
    ranked = round_candidates(spec_lanes, shapes, estimates, alpha=1.0, waiting=0.05,
                              mode=SpeculationMode.ADAPTIVE)
    table = LaneTable(spec_lanes, 5, alpha=1.0, optimistic=False)
    brute = [c for s in shapes for c in _host_candidates(s, table, estimates[s], 0.05,
                                                         SpeculationMode.ADAPTIVE)]
    best = min(brute, key=rank_key)
    assert ranked[0].shape == best.shape
    assert ranked[0].lane_index.tolist() == best.lane_index.tolist()
    assert ranked[0].rate == pytest.approx(best.rate)


@pytest.mark.parametrize("seed", range(24))
def test_sel_32_prefiltered_programs_rank_exactly_as_the_full_filter(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``RoundPrograms.host_for`` drops rectangular programs with ``B`` >= lanes beyond
    the smallest of their ``(D, W)`` before pricing: every ranked candidate, to the bit
    and in order, equals the ranking over every host program with the dominance filter
    alone (SEL-32), at every lane count."""
    rng = random.Random(500 + seed)
    shapes = catalog(rng)
    spec_lanes = lanes(rng, rng.randint(1, 8), ties=seed % 3 == 0)
    estimates = {s: 0 if rng.random() < 0.2 else rng.randint(3, 40) * 1_000_000
                 for s in shapes}
    kwargs = dict(alpha=rng.choice((0.5, 1.0)), waiting=rng.uniform(0.0, 0.3),
                  mode=rng.choice(list(SpeculationMode)))
    got = round_candidates(spec_lanes, shapes, estimates, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(RoundPrograms, "host_for", lambda self, lanes: self.host)
    want = round_candidates(spec_lanes, shapes, estimates, **kwargs)  # type: ignore[arg-type]
    assert len(got) == len(want) and got
    for a, b in zip(got, want, strict=True):
        same(a, b)


def test_sel_32_host_for_keeps_the_smallest_batch_holding_every_lane() -> None:
    programs = RoundPrograms(catalog(random.Random(1))[:20])  # the rectangular B x D grid
    kept = {(programs.shapes[i].batch_capacity, programs.shapes[i].proposal_depth)
            for i in programs.host_for(3)}
    assert kept == {(b, d) for b in (1, 2, 4) for d in range(5)}
    assert {programs.shapes[i].batch_capacity for i in programs.host_for(1)} == {1}
