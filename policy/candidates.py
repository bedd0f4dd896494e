"""The ordinary candidates of one decision and their ranking (seed: *Useful service and
selection*, *Duration estimates*, *Mixed execution contract*, *Funded timing refresh*).

``selection.select`` asks this module for the ordinary winner. The candidates form a
table in families, in table order:

0. decode shapes with their top-m decoder cohort (SEL-25);
1. snapshot shapes with their top-m terminal cohort (PRE-44);
2. prefill shapes x prompt rows: tokens up to the logical end (SEL-39..41);
3. scored prefill shapes x scored prompt rows;
4. ordinary mixed shapes, decode-only (only each batch bucket's smallest prompt
   capacity: larger ones repeat its logical work and are dominated, SEL-32);
5. ordinary mixed shapes with the best prompt row plus the top B-1 decoders (MIX-18).

A row is (family, flat): flat is ``prompt row * width + column`` for the prefill
families and the column otherwise. Ranking: dominated rows (SEL-32, SEL-33) and DUR-20
exclusions never win; unknown durations come first, by useful value (DUR-22, DUR-23);
measured ones by the F-SEL rate; exact ties by ``Candidate.tie_key`` (DUR-24, OPEN-19).
With full refresh credit the least recently touched stale alternative displaces a
measured winner (REF-7, REF-8, OPEN-9; dominated rows included, SEL-37).

The table is small (tens of shapes, a few dozen requests), and the decision runs
between device completions with cold caches, where each numpy call costs several
microseconds. So the rows are walked as Python floats over lists cached per catalog
(shapes, cohort sizes and dominance per request count, the mixed grid) and per
estimate version (durations), skipping dominated rows by construction, with the same
IEEE operations in the same order as the vectorised table in
``selection_reference.py``, which is kept as the executable specification; the tests
require bit-identical decisions from both. The families' numbering, the row value and
the per-catalog constants the walk reads are ``policy/candidate_families.py``.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

import numpy as np

from policy.candidate_families import (
    MIXED_DECODE,
    MIXED_PROMPT,
    PREFILL,
    SCORED_PREFILL,
    SNAPSHOT,
    Candidate,
    CohortSizes,
    FamilyShapes,
    FamilyTimes,
    cohort_sizes,
    dominated_by_smaller,
    family_shapes,
    family_times,
)

if TYPE_CHECKING:
    from policy.decision_context import DecisionContext, LaneGroup

_NEG_INF = -math.inf


class _Tracker:
    """The best primary key so far among measured rows (F-SEL rate) and among unknown
    rows (useful value), with every row attaining it."""

    __slots__ = ("known_best", "known_hits", "unknown_best", "unknown_hits")

    def __init__(self) -> None:
        self.known_best = _NEG_INF
        self.known_hits: list[tuple[int, int]] = []
        self.unknown_best = _NEG_INF
        self.unknown_hits: list[tuple[int, int]] = []

    def unknown(self, value: float, row: tuple[int, int]) -> None:
        if value > self.unknown_best:
            self.unknown_best, self.unknown_hits = value, [row]
        elif value == self.unknown_best:
            self.unknown_hits.append(row)


class Candidates:
    """The candidate table of one decision, walked row by row (see the module
    docstring); ``best`` and ``refresh`` rank it, ``candidate`` describes a row."""

    __slots__ = ("_best_pos", "_best_tokens", "_best_value", "_ctx", "_first_c", "_mixed",
                 "families")

    def __init__(self, ctx: DecisionContext) -> None:
        self._ctx = ctx
        cat, p = ctx.catalog, ctx.prompts
        n_dec, n_prompts = len(ctx.decoders), len(p.records)
        present = [len(cat.decode) > 0 and n_dec > 0,
                   len(cat.snapshot) > 0 and len(ctx.terminals) > 0,
                   len(cat.prefill) > 0 and len(p.ordinary) > 0,
                   len(cat.scored_prefill) > 0 and len(p.scored_list) > 0,
                   len(cat.mixed) > 0 and n_dec > 0,
                   len(cat.mixed) > 0 and n_prompts > 0 and len(p.ordinary) > 0]
        self.families = [kind for kind in range(6) if present[kind]]
        self._mixed = present[MIXED_PROMPT]
        self._best_pos: list[int] = []
        self._best_tokens: list[int] = []
        self._best_value: list[float] = []
        self._first_c: list[bool] = []
        if self._mixed:
            self._best_per_capacity()

    # ---- the mixed prompt row per distinct prompt capacity ----------------------------

    def _best_per_capacity(self) -> None:
        """The best ordinary prompt row at each distinct mixed prompt capacity; rows are
        ordered least recently served first, so the first maximum is the DUR-24
        tie-break (MIX-18). Equal work forms runs along C: ``_first_c``."""
        p = self._ctx.prompts
        rem, price, finish, reaches = p.remaining, p.price, p.finish, p.reaches
        # A row's value at capacity C is C * price below its logical end (rem > C) and
        # its end value from there on. Rows by remaining tokens: below position j of
        # ``by_rem`` they have ended at C = rems[j - 1]... The best ended row over each
        # prefix and the highest price over each suffix give every capacity's first
        # maximum without visiting every (row, capacity) pair.
        by_rem = sorted(p.ordinary, key=rem.__getitem__)
        rems = [rem[pos] for pos in by_rem]
        n = len(by_rem)
        ended = [(_NEG_INF, -1)]  # (best end value, first row attaining it) per prefix
        top_v, top_p = _NEG_INF, -1
        for pos in by_rem:
            v = rem[pos] * price[pos] + (finish[pos] if reaches[pos] else 0.0)
            if v > top_v or (v == top_v and pos < top_p):
                top_v, top_p = v, pos
            ended.append((top_v, top_p))
        # (highest price, first row with it, next lower price) per suffix.
        running: list[tuple[float, int, float]] = [(_NEG_INF, -1, _NEG_INF)] * (n + 1)
        p1, q1, p2 = _NEG_INF, -1, _NEG_INF
        for j in range(n - 1, -1, -1):
            pos = by_rem[j]
            pr = price[pos]
            if pr > p1:
                p1, q1, p2 = pr, pos, p1
            elif pr == p1:
                q1 = min(q1, pos)
            elif pr > p2:
                p2 = pr
            running[j] = (p1, q1, p2)
        for c in self._ctx.catalog.mixed_grid.caps_list:
            j = bisect.bisect_right(rems, c)
            best_v, best_p = ended[j]
            best_t = rem[best_p] if best_p >= 0 else 0
            if j < n:
                p1, q1, p2 = running[j]
                v = c * p1 + 0.0
                if c * p2 + 0.0 == v:
                    # A lower price rounds to the same value: find the first row.
                    q1 = min(pos for pos in by_rem[j:] if c * price[pos] + 0.0 == v)
                if v > best_v or (v == best_v and q1 < best_p):
                    best_v, best_p, best_t = v, q1, c
            self._best_value.append(best_v)
            self._best_pos.append(best_p)
            self._best_tokens.append(best_t)
        bp, bt = self._best_pos, self._best_tokens
        self._first_c = [c == 0 or bp[c] != bp[c - 1] or bt[c] != bt[c - 1]
                         for c in range(len(bp))]

    def _mixed_eligible(self, sizes: CohortSizes) -> list[bool]:
        grid = self._ctx.catalog.mixed_grid
        col_c = grid.col_c_list
        if grid.full:
            # On a complete grid a column is undominated exactly when it starts both
            # its run along B (same cohort) and its run along C (same work): SEL-32/33.
            first_c = self._first_c
            return [fb and first_c[c] for fb, c in zip(sizes.eligible, col_c, strict=True)]
        keys = np.array([[self._best_pos[c], self._best_tokens[c], m]
                         for c, m in zip(col_c, sizes.m, strict=True)], dtype=np.int64)
        keys = keys.reshape(len(col_c), 3)
        eligible: list[bool] = (~dominated_by_smaller(keys, grid.batch,
                                                       grid.prompt_caps)).tolist()
        return eligible

    # ---- ranking ------------------------------------------------------------------------

    def best(self) -> Candidate | None:
        """The ordinary winner, or None when every row is dominated or excluded."""
        ctx = self._ctx
        w = ctx.waiting
        track = _Tracker()
        for kind in self.families:
            fam = family_shapes(ctx.catalog, kind)
            t = family_times(ctx.times, kind, fam.shapes)
            allowed = self._within_gap(kind, t)
            if kind in (PREFILL, SCORED_PREFILL):
                self._walk_prefill(kind, fam, t, w, track, allowed)
                continue
            grid = ctx.catalog.mixed_grid
            if kind == MIXED_PROMPT and t.all_known and grid.full:
                group, base_of = ctx.decoders, None
            else:
                group, base_of = self._cohort_source(kind)
            sizes = cohort_sizes(ctx.catalog, kind, len(group))
            pre, gs = group.prefix_list, group.slope
            best, hits = track.known_best, track.known_hits
            if kind == MIXED_PROMPT and t.all_known and grid.full:
                # The complete-grid rule inline (``_mixed_eligible``): a column counts
                # when it starts its run along B and its run along C.
                value, first_c = self._best_value, self._first_c
                for j, (m, first_b, c, s, h) in enumerate(zip(
                        sizes.m, sizes.eligible, grid.col_c_list, t.safe, t.half,
                        strict=True)):
                    if first_b and first_c[c] and (allowed is None or allowed[j]):
                        rate = (value[c] + pre[m] + m * gs * s) / s - h * w
                        if rate >= best:
                            if rate > best:
                                best, hits = rate, [(kind, j)]
                            else:
                                hits.append((kind, j))
                track.known_best, track.known_hits = best, hits
                continue
            eligible = self._mixed_eligible(sizes) if kind == MIXED_PROMPT else sizes.eligible
            if allowed is not None:
                eligible = [e and a for e, a in zip(eligible, allowed, strict=True)]
            if t.all_known:
                for j, (m, ok, s, h) in enumerate(zip(sizes.m, eligible, t.safe, t.half,
                                                      strict=True)):
                    if ok:
                        base = pre[m] if base_of is None else base_of[j] + pre[m]
                        rate = (base + m * gs * s) / s - h * w
                        if rate >= best:
                            if rate > best:
                                best, hits = rate, [(kind, j)]
                            else:
                                hits.append((kind, j))
            else:
                known, safe, half = t.known, t.safe, t.half
                for j, m in enumerate(sizes.m):
                    if not eligible[j]:
                        continue
                    base = pre[m] if base_of is None else base_of[j] + pre[m]
                    if known[j]:
                        s = safe[j]
                        rate = (base + m * gs * s) / s - half[j] * w
                        if rate > best:
                            best, hits = rate, [(kind, j)]
                        elif rate == best:
                            hits.append((kind, j))
                    else:
                        track.unknown(base, (kind, j))
            track.known_best, track.known_hits = best, hits
        hits = track.unknown_hits or track.known_hits
        if not hits:
            return None
        if len(hits) == 1:
            return self.candidate(*hits[0])
        return min((self.candidate(*row) for row in hits), key=Candidate.tie_key)

    def _within_gap(self, kind: int, t: FamilyTimes) -> list[bool] | None:
        """flare's stream gap limit (U-13) over a family with prompt chunks: whether each
        shape may run, or None when no limit is set or the family has no prompt chunk.

        While streams decode, a prompt chunk rides in a frame that carries every
        decoding stream, if the catalog has one; otherwise a frame that leaves a stream
        out holds it for the frame and then its decode frame (``decode_ms``). Either
        way a frame may hold the streams at most r times the family's shortest measured
        such frame, less what frames have already held the longest-waiting stream
        (``stream_wait_ms``). An unmeasured shape is not limited."""
        ctx = self._ctx
        r = ctx.stream_gap_ratio
        if not r or kind not in (PREFILL, SCORED_PREFILL, MIXED_PROMPT):
            return None
        streams = len(ctx.decoders)
        if kind == MIXED_PROMPT:
            served = cohort_sizes(ctx.catalog, kind, streams).m
        else:
            served = len(t.safe) * [0]
        carriers = self._mixed and max(cohort_sizes(ctx.catalog, MIXED_PROMPT, streams).m,
                                       default=0) >= streams
        out = math.inf if carriers else ctx.decode_ms
        held = [safe if m >= streams else safe + out
                for safe, m in zip(t.safe, served, strict=True)]
        shortest = min((h for h, known in zip(held, t.known, strict=True) if known),
                       default=math.inf)
        allowance = r * shortest - ctx.stream_wait_ms
        return [not known or h <= allowance < math.inf
                for h, known in zip(held, t.known, strict=True)]

    def _cohort_source(self, kind: int) -> tuple[LaneGroup, list[float] | None]:
        """The lane group of a cohort family and, for mixed prompt steps, each column's
        prompt row value (the cohort then adds to it)."""
        ctx = self._ctx
        if kind == SNAPSHOT:
            return ctx.terminals, None
        if kind == MIXED_PROMPT:
            value = self._best_value
            return ctx.decoders, [value[c] for c in ctx.catalog.mixed_grid.col_c_list]
        return ctx.decoders, None

    def _walk_prefill(self, kind: int, fam: FamilyShapes, t: FamilyTimes, w: float,
                      track: _Tracker, allowed: list[bool] | None) -> None:
        """Prefill rows: a capacity consuming the same tokens as the previous one is
        dominated (SEL-32), so a row stops at the first capacity reaching its logical
        end; DUR-20 excludes an unmeasured capacity when the previous one already
        covers the next endpoint. A column ``allowed`` marks False is over the stream gap
        limit and scores nothing."""
        p = self._ctx.prompts
        rem_of, price_of, finish_of, reaches_of = p.remaining, p.price, p.finish, p.reaches
        endpoint_of = p.endpoint
        caps, known, safe, half = fam.caps, t.known, t.safe, t.half
        width = len(caps)
        best, hits = track.known_best, track.known_hits
        rows = p.ordinary if kind == PREFILL else p.scored_list
        if t.all_known:
            self._walk_measured_prefill(kind, caps, safe, [h * w for h in half], rows,
                                        track, allowed)
            return
        for ri, pos in enumerate(rows):
            rem, price = rem_of[pos], price_of[pos]
            finish = finish_of[pos] if reaches_of[pos] else 0.0
            previous = -1
            for col in range(width):
                c = caps[col]
                tokens = c if c < rem else rem
                if tokens == previous:
                    continue  # dominated; only equal capacities repeat below the end
                previous = tokens
                if col and not known[col] and caps[col - 1] >= endpoint_of[pos]:
                    continue  # DUR-20
                value = tokens * price + (finish if tokens == rem else 0.0)
                if allowed is not None and not allowed[col]:
                    pass  # over the stream gap limit
                elif known[col]:
                    rate = value / safe[col] - half[col] * w
                    if rate > best:
                        best, hits = rate, [(kind, ri * width + col)]
                    elif rate == best:
                        hits.append((kind, ri * width + col))
                else:
                    track.unknown(value, (kind, ri * width + col))
                if tokens == rem:
                    break  # every larger capacity repeats this work
        track.known_best, track.known_hits = best, hits

    def _walk_measured_prefill(self, kind: int, caps: list[int], safe: list[float],
                               waits: list[float], rows: list[int], track: _Tracker,
                               allowed: list[bool] | None) -> None:
        """The measured prefill family without visiting every (row, capacity) cell.

        No DUR-20 exclusion applies. A row's cells below its logical end consume the
        capacity's tokens (value ``C * price``), so at one capacity the rows still
        short of their end differ only in price, and the F-SEL rate is non-decreasing
        in the price (each rounded step is monotone): the highest price among them
        attains the column's maximum. Each row's first capacity reaching its end is its
        own cell (later ones repeat its work and are dominated, SEL-32), and so is a
        repeated capacity. A column whose maximum ties the best is expanded into every
        cell attaining it (rows with lower prices may round to the same rate), so ties
        are broken exactly as over the whole table (DUR-24)."""
        p = self._ctx.prompts
        rem_of, price_of = p.remaining, p.price
        width = len(caps)
        best, hits = track.known_best, track.known_hits
        # Rows by remaining tokens; top_price[j]: the highest price among the rows from
        # position j on (the ones with the most remaining tokens).
        by_rem = sorted(range(len(rows)), key=lambda ri: rem_of[rows[ri]])
        rems = [rem_of[rows[ri]] for ri in by_rem]
        top_price = [0.0] * (len(rows) + 1)
        top = -math.inf
        for j in range(len(rows) - 1, -1, -1):
            price = price_of[rows[by_rem[j]]]
            if price > top:
                top = price
            top_price[j] = top
        lazy: list[tuple[int, float]] = []  # (column, its maximum rate) to expand
        previous = -1
        for col in range(width):
            c = caps[col]
            if c == previous:
                continue  # the same tokens as the previous capacity for every row here
            previous = c
            j = bisect.bisect_right(rems, c)
            if j == len(rows):
                break  # every row ends at or below c (and below every larger capacity)
            if allowed is not None and not allowed[col]:
                continue  # over the stream gap limit
            rate = (c * top_price[j] + 0.0) / safe[col] - waits[col]
            if rate >= best:
                if rate > best:
                    best, hits, lazy = rate, [], [(col, rate)]
                else:
                    lazy.append((col, rate))
        finish_of, reaches_of = p.finish, p.reaches
        for ri, pos in enumerate(rows):
            rem = rem_of[pos]
            col = bisect.bisect_left(caps, rem)
            if col == width or (allowed is not None and not allowed[col]):
                continue  # no capacity reaches the end (only unfinished cells), or over
                # the stream gap limit
            value = rem * price_of[pos] + (finish_of[pos] if reaches_of[pos] else 0.0)
            rate = value / safe[col] - waits[col]
            if rate >= best:
                if rate > best:
                    best, hits, lazy = rate, [(kind, ri * width + col)], []
                else:
                    hits.append((kind, ri * width + col))
        for col, rate in lazy:
            if rate != best:
                continue
            c, s, hw = caps[col], safe[col], waits[col]
            for ri, pos in enumerate(rows):
                if rem_of[pos] > c and (c * price_of[pos] + 0.0) / s - hw == best:
                    hits.append((kind, ri * width + col))
        track.known_best, track.known_hits = best, hits

    def refresh(self, winner_shape: int) -> Candidate | None:
        """The funded refresh alternative (REF-7, REF-8, OPEN-9, SEL-37): among rows of
        stale shapes other than the winner's, dominated ones included, the least
        recently touched first, then the ordinary ranking. Stale implies measured, and
        only unmeasured prefill rows are DUR-20 exclusions, so none is excluded by
        DUR-20; shapes over flare's stream gap limit are (U-13)."""
        ctx = self._ctx
        stale, touched = ctx.stale, ctx.last_touched_ns
        pool: list[tuple[int, float, int, int]] = []
        for kind in self.families:
            fam = family_shapes(ctx.catalog, kind)
            allowed = self._within_gap(kind, family_times(ctx.times, kind, fam.shapes))
            cols = [j for j, s in enumerate(fam.shapes) if stale[s] and s != winner_shape
                    and (allowed is None or allowed[j])]
            if not cols:
                continue
            width = len(fam.shapes)
            rows = range(1) if kind not in (PREFILL, SCORED_PREFILL) else range(
                len(ctx.prompts.ordinary if kind == PREFILL else ctx.prompts.scored_list))
            for r in rows:
                for j in cols:
                    flat = r * width + j
                    cand = self.candidate(kind, flat)
                    pool.append((int(touched[fam.shapes[j]]), -cand.rate, kind, flat))
        if not pool:
            return None
        first = min((lt, neg) for lt, neg, _, _ in pool)
        tied = [self.candidate(kind, flat) for lt, neg, kind, flat in pool
                if (lt, neg) == first]
        return min(tied, key=Candidate.tie_key)

    # ---- one row ------------------------------------------------------------------------

    def candidate(self, kind: int, flat: int) -> Candidate:
        """Row ``flat`` of family ``kind`` with every ranking column and its plan."""
        ctx = self._ctx
        fam = family_shapes(ctx.catalog, kind)
        t = family_times(ctx.times, kind, fam.shapes)
        w = ctx.waiting
        if kind in (PREFILL, SCORED_PREFILL):
            p = ctx.prompts
            width = len(fam.shapes)
            r, col = divmod(flat, width)
            pos = (p.ordinary if kind == PREFILL else p.scored_list)[r]
            rem, cap = p.remaining[pos], fam.caps[col]
            tokens = cap if cap < rem else rem
            base = tokens * p.price[pos] + (
                p.finish[pos] if tokens == rem and p.reaches[pos] else 0.0)
            rate = base / t.safe[col] - t.half[col] * w
            return Candidate(kind, flat, fam.shapes[col], base, rate, t.known[col],
                             t.est[col], 1, p.last_served_list[pos], 0, cap - tokens, pos,
                             tokens, 0, 0)
        group, base_of = self._cohort_source(kind)
        sizes = cohort_sizes(ctx.catalog, kind, len(group))
        m = sizes.m[flat]
        base = group.prefix_list[m] if base_of is None else base_of[flat] + group.prefix_list[m]
        s = t.safe[flat]
        rate = (base + m * group.slope * s) / s - t.half[flat] * w
        lru = group.lru_list[m]
        batch = fam.batch[flat]
        if kind == MIXED_PROMPT:
            c = ctx.catalog.mixed_grid.col_c_list[flat]
            pos, tokens = self._best_pos[c], self._best_tokens[c]
            last = ctx.prompts.last_served_list[pos]
            lru = min(last, lru) if m > 0 else last
            return Candidate(kind, flat, fam.shapes[flat], base, rate, t.known[flat],
                             t.est[flat], m + 1, lru, batch - m - 1, fam.caps[flat] - tokens,
                             pos, tokens, m, 0)
        pad_tokens = fam.caps[flat] if kind == MIXED_DECODE else 0
        terminal = kind == SNAPSHOT
        return Candidate(kind, flat, fam.shapes[flat], base, rate, t.known[flat],
                         t.est[flat], m, lru, batch - m, pad_tokens, -1, 0,
                         0 if terminal else m, m if terminal else 0)
