"""Descriptor types shared by the scheduler and the prepared programs.

This module owns the *physical identity* of a prepared program (its kind and fixed
capacities) and the timing record every execution returns. It is imported by ``gpu/``
so that the scheduler and the programs share one definition; it must stay free of
torch, trio and clocks.

Seed sections: *Speculative graph coverage* (B/D/W/P), *Duration estimates* (the cost
identity: kind, batch capacity, token capacity, proposal depth, mixed prefill capacity,
packed verification capacity; active rows never change it), *Mixed execution contract*.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_REQUEST_SLOTS = 64
"""Selection is bounded to 64 request slots (seed: Useful service and selection)."""

DEFAULT_COMPLETION_TOKEN_CAPACITY = 8
"""Decode width limit when a model core declares none (seed: Mixed execution contract)."""

PROMPT_ALIGNMENT = 64
"""Prefill and mixed prompt capacities are positive multiples of 64."""


class IdentityEnum(enum.Enum):
    """An ``Enum`` hashed by identity, in C. Members are singletons compared by identity,
    so equality is unchanged; ``Enum.__hash__`` is a Python function
    (``hash(self._name_)``), and selection hashes shapes (whose fields hold these
    enums) and proposal sources hundreds of times per decision."""

    __hash__ = object.__hash__


class GraphKind(IdentityEnum):
    """The seven program families of the native catalog (seed: intro, CAT-9)."""

    PREFILL = "prefill"
    SCORED_PREFILL = "scored_prefill"
    DECODE = "decode"
    SPECULATIVE = "speculative"
    MIXED = "mixed"
    VISION = "vision"
    STATE = "state"


class StateOp(IdentityEnum):
    """Which state operation a ``GraphKind.STATE`` program performs (OPEN-39).

    Restore and initialization are state operations in flare.
    """

    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    PAGE_COPY = "page_copy"
    INITIALIZE = "initialize"


class TargetBinding(IdentityEnum):
    """Who allocates a speculative program's target rows (seed: SPEC-18).

    ``QUERY_LENGTH``: the host fixes per-lane lengths whose sum fits P.
    ``SPECULATIVE_PREFIX_LIMIT``: the host supplies immutable lane ceilings and the
    program allocates within P by joint prefix probability.
    """

    QUERY_LENGTH = "QueryLength"
    SPECULATIVE_PREFIX_LIMIT = "SpeculativePrefixLimit"


class DescriptorError(ValueError):
    """Raised when a graph descriptor violates the catalog's shape rules."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphShape:
    """One prepared physical program: its kind and every fixed capacity.

    The whole value is the cost identity (DUR-4, OPEN-27: every kind uses the
    superset key). Field meanings by kind:

    - PREFILL / SCORED_PREFILL: ``batch_capacity`` 1, ``token_capacity`` = the chunk
      capacity C (a multiple of 64).
    - DECODE: ``batch_capacity`` B (power of two), ``token_capacity`` 1,
      ``packed_capacity`` B.
    - SPECULATIVE: B, W (``token_capacity``, includes the pending token), D
      (``proposal_depth``), P (``packed_capacity``) and the target ``binding``.
    - MIXED: B (2..64), W (decode width), ``prefill_capacity`` (a multiple of 64),
      ``packed_capacity`` = the maximum packed extent ``prefill + (B - 1) * W``.
    - STATE: ``batch_capacity`` rows, ``state_op`` names the operation.
    - VISION: ``batch_capacity`` I images encoded per execution, ``token_capacity``
      their feature tokens (I x tokens per image); a lane is one request's images.
    """

    kind: GraphKind
    batch_capacity: int
    token_capacity: int
    proposal_depth: int = 0
    prefill_capacity: int = 0
    packed_capacity: int = 0
    binding: TargetBinding | None = None
    state_op: StateOp | None = None
    speculation_enabled: bool = False
    """Mixed/width-one programs that maintain draft state (MIX-6)."""

    def __post_init__(self) -> None:
        validate_shape(self)

    @property
    def is_generation(self) -> bool:
        """Ordinary decode or complete speculative generation: the only kinds that
        may occupy both frame slots (QUEUE-11)."""
        return self.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE)

    @property
    def max_packed_extent(self) -> int:
        """Largest number of packed target tokens one execution can hold."""
        if self.kind is GraphKind.MIXED:
            return self.prefill_capacity + (self.batch_capacity - 1) * self.token_capacity
        if self.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            return self.token_capacity
        return self.packed_capacity or self.batch_capacity * self.token_capacity

    def capacities(self) -> tuple[int, int, int, int]:
        """The physical capacities compared by the dominance filter (SEL-32).

        Proposal depth is excluded: speculative candidates are compared only at the
        same actual depth (SEL-34).
        """
        return (
            self.batch_capacity,
            self.token_capacity,
            self.prefill_capacity,
            self.packed_capacity,
        )

    def label(self) -> str:
        """A short stable name for logs, metrics and benchmark tables."""
        k = self.kind
        if k in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            return f"{k.value}[C={self.token_capacity}]"
        if k is GraphKind.DECODE:
            return f"decode[B={self.batch_capacity}]"
        if k is GraphKind.SPECULATIVE:
            b = self.binding.value if self.binding else "?"
            return (
                f"speculative[B={self.batch_capacity},D={self.proposal_depth},"
                f"W={self.token_capacity},P={self.packed_capacity},{b}]"
            )
        if k is GraphKind.MIXED:
            spec = ",spec" if self.speculation_enabled else ""
            return (
                f"mixed[B={self.batch_capacity},W={self.token_capacity},"
                f"C={self.prefill_capacity}{spec}]"
            )
        if k is GraphKind.STATE:
            op = self.state_op.value if self.state_op else "?"
            return f"state.{op}[B={self.batch_capacity}]"
        if k is GraphKind.VISION:
            return f"vision[I={self.batch_capacity}]"
        return f"{k.value}[B={self.batch_capacity}]"


def validate_shape(shape: GraphShape) -> None:
    """Check the seed's shape rules; raise ``DescriptorError`` naming the rule."""
    k = shape.kind
    for name in ("batch_capacity", "token_capacity", "proposal_depth",
                 "prefill_capacity", "packed_capacity"):
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DescriptorError(f"{name} must be a non-negative int, got {value!r}")
    if shape.batch_capacity < 1 and k is not GraphKind.VISION:
        raise DescriptorError("batch_capacity must be positive")
    if shape.batch_capacity > MAX_REQUEST_SLOTS:
        raise DescriptorError(f"batch_capacity above {MAX_REQUEST_SLOTS} request slots")
    if k is not GraphKind.MIXED and shape.prefill_capacity != 0:
        raise DescriptorError("only mixed graphs declare a prefill_capacity (MIX-5)")
    if k is not GraphKind.STATE and shape.state_op is not None:
        raise DescriptorError("state_op is only for state-operation graphs")
    if k is not GraphKind.SPECULATIVE and shape.binding is not None:
        raise DescriptorError("only speculative graphs declare a target binding")
    if k in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        if shape.batch_capacity != 1:
            raise DescriptorError("prefill graphs serve one request (batch_capacity 1)")
        if shape.token_capacity <= 0 or shape.token_capacity % PROMPT_ALIGNMENT:
            raise DescriptorError("prefill capacity must be a positive multiple of 64")
    elif k is GraphKind.DECODE:
        if not _is_power_of_two(shape.batch_capacity):
            raise DescriptorError("decode batch capacity must be a power of two (SPEC-10)")
        if shape.token_capacity != 1 or shape.proposal_depth != 0:
            raise DescriptorError("ordinary decode has width 1 and no proposals")
    elif k is GraphKind.SPECULATIVE:
        b, w, d, p = (shape.batch_capacity, shape.token_capacity,
                      shape.proposal_depth, shape.packed_capacity)
        if not _is_power_of_two(b):
            raise DescriptorError("speculative batch capacity must be a power of two")
        if w < 1:
            raise DescriptorError("speculative width W must be at least 1")
        if w == 1 and d != 0:
            raise DescriptorError("width-one programs have D = 0 (SPEC-4)")
        if p < 1 or p > b * w:
            raise DescriptorError("packed capacity P must lie in 1..B*W")
        if shape.binding is None:
            raise DescriptorError("speculative graphs declare a target binding (SPEC-18)")
    elif k is GraphKind.MIXED:
        if not _is_power_of_two(shape.batch_capacity) or shape.batch_capacity < 2:
            raise DescriptorError("mixed batch capacity is a power of two from 2 to 64 (MIX-2)")
        if not 1 <= shape.token_capacity <= DEFAULT_COMPLETION_TOKEN_CAPACITY:
            raise DescriptorError("mixed decode width is 1..8 (MIX-3)")
        if shape.prefill_capacity <= 0 or shape.prefill_capacity % PROMPT_ALIGNMENT:
            raise DescriptorError("mixed prompt capacity is a positive multiple of 64 (MIX-4)")
        if shape.prefill_capacity < shape.token_capacity:
            raise DescriptorError("mixed prompt capacity is at least the decode width (MIX-17)")
    elif k is GraphKind.STATE and shape.state_op is None:
        raise DescriptorError("state graphs name their state_op")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionTiming:
    """What one execution measured (seed: Duration estimates; arch: Timing).

    ``device_intervals_ns``: each rank's device interval (CUDA event elapsed time, or
    the CPU worker's measured interval); 0 means missing.
    ``wall_ns``: host wall time from dispatch to observed completion.
    ``readiness_delay_ns``: exposed embedding-delivery delay (0 in flare, OPEN-21).
    """

    device_intervals_ns: tuple[int, ...]
    wall_ns: int
    readiness_delay_ns: int = 0

    @property
    def device_ns(self) -> int:
        """The raw device observation: the maximum positive rank-local interval (DUR-14)."""
        positive = [d for d in self.device_intervals_ns if d > 0]
        return max(positive) if positive else 0

    @property
    def cost_sample_ns(self) -> int:
        """The cost-model sample: raw device interval less exposed readiness delay (DUR-15).

        Zero when the device interval is missing (DUR-19).
        """
        raw = self.device_ns
        if raw <= 0:
            return 0
        return max(raw - max(self.readiness_delay_ns, 0), 0)
