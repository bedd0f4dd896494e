"""The inputs of one decision, as the selector reads them (seed: *Useful service and
selection*, *Duration estimates*, *Prerequisites and completion*).

This module owns the request-side data types between ``decision.build_context`` and
``selection.select`` (the catalog side, ``CatalogIndex`` and ``ShapeTimes``, is
``policy/catalog_index.py``):

- ``LaneGroup``, ``PromptGroup``, ``RestoreGroup``: the runnable requests by role, with
  their scaled values (SEL-5..7, SEL-14..20, PRE-44);
- ``DecisionContext``: everything one decision needs.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from policy.catalog_index import CatalogIndex, ShapeTimes
from policy.descriptors import StateOp
from policy.requests import RequestRecord
from policy.utility import BoolArray, FloatArray, IntArray


class LaneGroup:
    """Requests of one role sorted by descending base value (ties: least recently
    served first, then handle). A cohort of size m is the first m; its value is a prefix
    sum. Kept as Python lists (the selector walks them as floats); the numpy views
    ``base``/``prefix``/``lru_prefix_min`` are built on first use."""

    __slots__ = ("_arrays", "base_list", "lru_list", "prefix_list", "records", "slope")

    def __init__(self, records: tuple[RequestRecord, ...], base: list[float], slope: float,
                 prefix: list[float], lru: list[int]) -> None:
        self.records = records
        self.base_list = base
        self.slope = slope
        """Per-lane age slope ``c*sigma`` (scaled); uniform within a group."""
        self.prefix_list = prefix
        """``prefix_list[m]``: the summed base values of the first m lanes."""
        self.lru_list = lru
        """``lru_list[m]`` = least last-served time among the first m (m >= 1)."""
        self._arrays: dict[str, npt.NDArray[np.generic]] = {}

    @staticmethod
    def build(records: list[RequestRecord], base: list[float], slope: float,
              *, served: list[int] | None = None, handles: list[int] | None = None
              ) -> LaneGroup:
        """Sort ``records`` by descending ``base``, then least recently served, then
        handle. ``served``/``handles``: their ``last_served_ns`` and handles when the
        caller already has them. Prefix sums add in order, as ``utility.prefix_sums``."""
        n = len(records)
        if not n:  # common for terminals
            return LaneGroup((), [], slope, [0.0], [0])
        if served is None:
            served = [r.last_served_ns for r in records]
        if handles is None:
            handles = [r.handle for r in records]
        # Descending values (a reverse sort keeps equal values in order); equal values
        # go least recently served first, then by handle (DUR-24).
        order = sorted(range(n), key=base.__getitem__, reverse=True)
        if len(set(base)) < n:
            order = [i for _, _, _, i in sorted(zip([-v for v in base], served, handles,
                                                     range(n), strict=True))]
        if n == 1:
            return LaneGroup((records[0],), [base[0]], slope, [0.0, base[0]], [0, served[0]])
        pick = operator.itemgetter(*order)
        values = list(pick(base))
        return LaneGroup(pick(records), values, slope, [0.0, *itertools.accumulate(values)],
                         [0, *itertools.accumulate(pick(served), min)])

    def subset(self, keep: Callable[[RequestRecord], bool]) -> LaneGroup:
        """The lanes whose record ``keep`` accepts, in this group's order, with their
        own prefix sums (``self`` when it keeps them all)."""
        rows = [i for i, r in enumerate(self.records) if keep(r)]
        if len(rows) == len(self.records):
            return self
        values = [self.base_list[i] for i in rows]
        return LaneGroup(tuple(self.records[i] for i in rows), values, self.slope,
                         [0.0, *itertools.accumulate(values)],
                         [0, *itertools.accumulate(
                             (self.records[i].last_served_ns for i in rows), min)])

    def __len__(self) -> int:
        return len(self.records)

    def _array(self, name: str, values: list[float] | list[int],
               dtype: type[np.generic]) -> npt.NDArray[np.generic]:
        cached = self._arrays.get(name)
        if cached is None:
            cached = self._arrays[name] = np.array(values, dtype=dtype)
        return cached

    @property
    def base(self) -> FloatArray:
        return cast(FloatArray, self._array("base", self.base_list, np.float64))

    @property
    def prefix(self) -> FloatArray:
        return cast(FloatArray, self._array("prefix", self.prefix_list, np.float64))

    @property
    def lru_prefix_min(self) -> IntArray:
        return cast(IntArray, self._array("lru", self.lru_list, np.int64))


class PromptGroup:
    """Requests with prompt work, least recently served first (one entry per request),
    as Python lists; the numpy views (``logical_remaining`` ...) are built on first use.

    ``remaining``: tokens up to the logical end (system boundary or prompt end,
    SEL-40); ``endpoint``: up to the next message or prompt endpoint (DUR-20);
    ``reaches``: consuming all of ``remaining`` finishes the prompt; ``price``: the
    scaled prefill token price ``1 + f/x``; ``finish``: the scaled value of the first
    output (output token price + delivery price); ``ordinary``/``scored_list``: the
    positions of the rows without and with scoring; ``held``: rows in neither, whose
    next chunk waits for a vision prerequisite or must hold an image whole
    (``policy.vision_prerequisites`` scores them)."""

    __slots__ = ("_arrays", "cursor_list", "endpoint", "finish", "held", "last_served_list",
                 "ordinary", "price", "reaches", "records", "remaining", "scored_list")

    def __init__(self, records: tuple[RequestRecord, ...], *, cursor: list[int],
                 remaining: list[int], endpoint: list[int], reaches: list[bool],
                 price: list[float], finish: list[float], last_served: list[int],
                 scored: list[int], held: list[int] | None = None) -> None:
        self.records = records
        self.cursor_list = cursor
        self.remaining = remaining
        self.endpoint = endpoint
        self.reaches = reaches
        self.price = price
        self.finish = finish
        self.last_served_list = last_served
        self.held = held or []
        if self.held:
            scored = [i for i in scored if i not in self.held]
        self.scored_list = scored
        self.ordinary = [i for i in range(len(records))
                         if i not in scored and i not in self.held] \
            if scored or self.held else list(range(len(records)))
        self._arrays: dict[str, npt.NDArray[np.generic]] = {}

    def _array(self, name: str, values: list[float] | list[int] | list[bool],
               dtype: type[np.generic]) -> npt.NDArray[np.generic]:
        cached = self._arrays.get(name)
        if cached is None:
            cached = self._arrays[name] = np.array(values, dtype=dtype)
        return cached

    @property
    def cursor(self) -> IntArray:
        return cast(IntArray, self._array("cursor", self.cursor_list, np.int64))

    @property
    def logical_remaining(self) -> IntArray:
        return cast(IntArray, self._array("remaining", self.remaining, np.int64))

    @property
    def endpoint_remaining(self) -> IntArray:
        return cast(IntArray, self._array("endpoint", self.endpoint, np.int64))

    @property
    def reaches_prompt_end(self) -> BoolArray:
        return cast(BoolArray, self._array("reaches", self.reaches, np.bool_))

    @property
    def token_price(self) -> FloatArray:
        return cast(FloatArray, self._array("price", self.price, np.float64))

    @property
    def finish_value(self) -> FloatArray:
        return cast(FloatArray, self._array("finish", self.finish, np.float64))

    @property
    def last_served(self) -> IntArray:
        return cast(IntArray, self._array("last_served", self.last_served_list, np.int64))

    @property
    def scored(self) -> BoolArray:
        cached = self._arrays.get("scored")
        if cached is None:
            cached = np.zeros(len(self.records), dtype=np.bool_)
            cached[self.scored_list] = True
            self._arrays["scored"] = cached
        return cast(BoolArray, cached)

    @property
    def ordinary_rows(self) -> IntArray:
        return cast(IntArray, self._array("ordinary", self.ordinary, np.int64))

    @property
    def scored_rows(self) -> IntArray:
        return cast(IntArray, self._array("scored_rows", self.scored_list, np.int64))


@dataclass(slots=True)
class RestoreGroup:
    """Prerequisite-ready requests (newly ready rows of a prerequisite pair, PRE-7, or
    continuations of a longer chain, PRE-21), with their scaled lane values as decoders
    (``decoding``) or as prompt rows."""

    records: tuple[RequestRecord, ...]
    decoding: tuple[bool, ...]
    base: tuple[float, ...]
    """Decoder value at the planning start (age so far, with the row's own slope); 0
    for prompt rows."""
    slope: float
    """The family age slope of single-stage decoders (SEL-16)."""
    token_price: tuple[float, ...]
    finish_value: tuple[float, ...]
    remaining: tuple[int, ...]
    """Prompt tokens up to the logical end; 0 for decoders."""
    next_op: tuple[StateOp, ...] = ()
    """The prerequisite stage each row needs next."""
    multistage: tuple[bool, ...] = ()
    """Whether further prerequisite stages follow the next one (PRE-21)."""
    slopes: tuple[float, ...] = ()
    """Each row's own age slope: the family slope, or for a multistage decoder
    ``c * sigma_i`` with its individual future-delivery reference (SEL-18, OPEN-15)."""
    further_ms: tuple[float, ...] = ()
    """Fastest measured duration of the stages after the next one plus the row's first
    inference (F of the continuation index, PRE-21, PRE-23); unknown stages count 0.
    Only multistage rows use it; a single-stage prompt row's first chunk is not
    searched (0 there)."""
    continuation_value: tuple[float, ...] = ()
    """A multistage prompt row's value in its first prefill chunk (0 for decoders and
    single-stage rows)."""

    def continuation(self, i: int, first_ms: float) -> tuple[float, float]:
        """``(V, F)`` of row ``i`` for a prerequisite of duration ``first_ms``: a decoder's
        value ages to ``T + F`` with its own slope; a prompt row's is its first chunk."""
        further = self.further_ms[i]
        if self.decoding[i]:
            return self.base[i] + self.slopes[i] * (first_ms + further), further
        return self.continuation_value[i], further


@dataclass(slots=True)
class DecisionContext:
    """Everything one decision needs, already projected and scaled (read-only by
    convention; not frozen because it is built on every decision)."""

    catalog: CatalogIndex
    times: ShapeTimes
    estimate_ns: IntArray
    stale: BoolArray
    last_touched_ns: IntArray
    decoders: LaneGroup
    terminals: LaneGroup
    prompts: PromptGroup
    restorable: RestoreGroup
    waiting: float
    """Scaled sum of c_i over active decoders and pending terminals (SEL-19, PRE-45)."""
    terminal_coefficient: float
    """Scaled ``terminal_age_price``: a terminal row's share of ``waiting`` (PRE-46)."""
    exponent: int
    now_ns: int
    start_ns: int
    refresh_funded: bool
    stream_gap_ratio: float = 0.0
    """flare's stream gap limit r (``PolicyConfig.stream_gap_ratio``, U-13) while streams
    decode; 0: no limit (``candidates.Candidates._within_gap``)."""
    decode_ms: float = 0.0
    """The decode frame that serves the decoding streams alone, ms (0 without a limit):
    the wait a frame that leaves a stream out adds to its own duration."""
    stream_wait_ms: float = 0.0
    """How long frames have held the longest-waiting decoder, ms (0 without a limit):
    from its latest output, queued delivery or latest completed frame to the end of the
    frames completed or queued. The part of the limit already spent."""
