"""The catalog: which fixed-shape programs are prepared, derived from flags.

Seed sections: *Speculative graph coverage* (power-of-two request buckets, the
``--speculative-token-capacity R`` envelope), *Mixed execution contract* (the
``mixed_shapes`` rule of its last paragraphs, standing in for the seed's
``ignition/components/capacity.py::mixed_shapes``, MIX-39..49), CAT-12/13.

Rules:

- Request buckets are the powers of two up to the maximum batch (SPEC-10); ordinary
  decode is prepared at each bucket.
- Prefill and scored prefill are prepared at each configured capacity (multiples of 64).
- State operations (snapshot, restore, page copy, initialize) are one program each,
  for one request row (OPEN-39).
- Mixed programs exist only when ``--mixed-prefill`` is given *and* the model family
  declares mixed capture (CAT-12, CAT-13). Their batch buckets are the powers of two
  from 2 to the maximum batch (MIX-2). Every batch bucket has every prompt bucket at
  width one (MIX-40); a speculative load (draft depth D > 0) adds, per eligible wider
  width W (2..min(D + 1, completion token capacity), ``B * W <= R``), one program at the
  *balanced* prompt bucket, the one minimising ``max(P / P_min, P_max / P)`` with ties
  to the smaller (MIX-41, MIX-43). Speculative loads keep the draft-maintaining W=1
  variant, ordinary loads the plain one (MIX-6, MIX-44, MIX-47).
- flare's prompt-bucket ladder (OPEN-26): the powers of two from 64, plus the
  three-halves steps ``3 * 2**k`` from 768 on, up to the largest prefill capacity (which
  is always included). Small chunks are dominated by fixed per-program overhead, so a
  2x step costs little; large chunks are dominated by per-token work, so the finer 1.5x
  step halves the worst padding waste. For 4096-token chunks the ladder has ten
  buckets (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096), which with batch
  buckets {2, 4}, D = 5 and R = 6 reproduces the seed's 22 speculative and 20 ordinary
  mixed programs (MIX-45).
- Separate speculative programs (rectangular, ``P = B * W <= R``, SPEC-10..13,
  ``QueryLength``: the host fixes each lane's rows) are generated when a draft depth is
  given.
- Device allocation (``CatalogFlags.device_allocation``, adaptive selection only,
  SPEC-17) adds ragged ``SpeculativePrefixLimit`` programs beside them: at every
  request bucket ``B >= 2`` and every wider width ``W`` (2..min(D + 1, completion token
  capacity)), one program whose ``P`` holds every lane's pending row plus half of the
  draft rows, ``P = B + ceil(B * (W - 1) / 2)``, capped by R (SPEC-13; a cap leaving no
  draft row drops the program). The host supplies lane ceilings (which may sum above
  P, SPEC-26) and the program admits the P rows by joint prefix probability
  (SPEC-22..30); the rectangular host programs of the same B and W stay, so the
  scheduler prices both (SPEC-31). flare's choice of P (the seed names the envelope,
  not the shapes): ragged rows are where device allocation differs from host lengths
  (with ``P = B * W`` every ceiling fits), half the draft rows halves the verification
  work of a full-width round, and one program per width keeps the catalog linear in
  the widths. ``B = 1`` gets none: one lane's allocation is its ceiling cut to P,
  which a host length already expresses.

- Fixed-width speculation (MIX-7) serves ``fixed_width_shapes`` of the speculative load.
- Vision programs (CAT-9; ``vision_shapes``), for a vision-language load only
  (``actors.catalog_setup.served_shapes`` adds them to what ``build_catalog`` gives):
  one per image bucket, the powers of two up to the images one window holds (the
  feature storage, ``--vision-feature-images``), each encoding that many images
  (``batch_capacity`` I, ``token_capacity`` I x tokens per image). The scheduler runs
  them as prerequisites of the prompt chunks that read their features
  (``policy/vision_prerequisites.py``).

The whole catalog is computed before any preparation; preparation must cover exactly
it and the planner receives the same value (MIX-39, MIX-48).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from policy.descriptors import (
    DEFAULT_COMPLETION_TOKEN_CAPACITY,
    MAX_REQUEST_SLOTS,
    PROMPT_ALIGNMENT,
    GraphKind,
    GraphShape,
    StateOp,
    TargetBinding,
)

FINE_LADDER_START = 768
"""From here on the prompt-bucket ladder also has the 3 * 2**k steps (OPEN-26)."""


class CatalogError(ValueError):
    """Raised when catalog flags are invalid; the message names the flag."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def request_buckets(max_batch: int, *, minimum: int = 1) -> tuple[int, ...]:
    """Powers of two from ``minimum`` to ``max_batch`` (SPEC-10, MIX-2)."""
    if not _is_power_of_two(max_batch) or max_batch > MAX_REQUEST_SLOTS:
        raise CatalogError(f"max batch must be a power of two from 1 to 64, got {max_batch}")
    buckets = []
    b = 1
    while b <= max_batch:
        if b >= minimum:
            buckets.append(b)
        b *= 2
    return tuple(buckets)


def prompt_bucket_ladder(largest: int) -> tuple[int, ...]:
    """flare's mixed prompt buckets up to ``largest`` (a multiple of 64; OPEN-26)."""
    if largest <= 0 or largest % PROMPT_ALIGNMENT:
        raise CatalogError(f"largest prompt bucket must be a positive multiple of 64, got {largest}")
    ladder = set()
    p = PROMPT_ALIGNMENT
    while p <= largest:
        ladder.add(p)
        if 3 * p // 2 >= FINE_LADDER_START and 3 * p // 2 <= largest:
            ladder.add(3 * p // 2)
        p *= 2
    ladder.add(largest)
    return tuple(sorted(ladder))


def balanced_prompt_bucket(buckets: Iterable[int]) -> int:
    """The bucket minimising ``max(P / P_min, P_max / P)``; ties go to the smaller (MIX-41)."""
    ordered = sorted(set(buckets))
    if not ordered:
        raise CatalogError("no prompt buckets")
    p_min, p_max = ordered[0], ordered[-1]

    # Compare max(P / p_min, p_max / P) exactly, as fractions over p_min * P.
    def worst(p: int) -> tuple[int, int]:
        return max(p * p, p_max * p_min), p_min * p

    def less(a: int, b: int) -> bool:
        na, da = worst(a)
        nb, db = worst(b)
        return na * db < nb * da

    best = ordered[0]
    for p in ordered[1:]:
        if less(p, best):
            best = p
    return best


def eligible_widths(
    batch: int, *, draft_depth: int, envelope: int, completion_token_capacity: int
) -> tuple[int, ...]:
    """Wider widths W >= 2 a bucket may run: ``W <= min(D + 1, capacity)`` and, when
    ``envelope`` R > 0, ``batch * W <= R`` (SPEC-11, SPEC-12, MIX-41)."""
    top = min(draft_depth + 1, completion_token_capacity)
    return tuple(
        w for w in range(2, top + 1) if envelope <= 0 or batch * w <= envelope
    )


def mixed_shapes(
    *,
    max_batch: int,
    prompt_buckets: Iterable[int],
    draft_depth: int,
    envelope: int,
    completion_token_capacity: int = DEFAULT_COMPLETION_TOKEN_CAPACITY,
    wider: bool = True,
) -> tuple[GraphShape, ...]:
    """The joint mixed catalog (MIX-39..47). ``draft_depth`` 0 is an ordinary load.
    ``wider`` False leaves out the speculative programs above width one (flare's
    opt-in departure from MIX-41/MIX-43, ``CatalogFlags.speculative_mixed``)."""
    buckets = sorted(set(prompt_buckets))
    for p in buckets:
        if p <= 0 or p % PROMPT_ALIGNMENT:
            raise CatalogError(f"mixed prompt buckets must be positive multiples of 64, got {p}")
    if not buckets or max_batch < 2:
        return ()
    speculative = draft_depth > 0
    balanced = balanced_prompt_bucket(buckets)
    shapes: list[GraphShape] = []
    for b in request_buckets(max_batch, minimum=2):
        for p in buckets:
            shapes.append(_mixed(b, 1, p, speculative))
        if speculative and wider:
            for w in eligible_widths(
                b, draft_depth=draft_depth, envelope=envelope,
                completion_token_capacity=completion_token_capacity,
            ):
                if balanced >= w:  # MIX-17: a decode-only population must fit
                    shapes.append(_mixed(b, w, balanced, True))
    return tuple(shapes)


def _mixed(batch: int, width: int, prompt: int, speculation: bool) -> GraphShape:
    return GraphShape(
        kind=GraphKind.MIXED,
        batch_capacity=batch,
        token_capacity=width,
        proposal_depth=width - 1,
        prefill_capacity=prompt,
        packed_capacity=prompt + (batch - 1) * width,
        speculation_enabled=speculation,
    )


def speculative_shapes(
    *, max_batch: int, draft_depth: int, envelope: int,
    completion_token_capacity: int = DEFAULT_COMPLETION_TOKEN_CAPACITY,
) -> tuple[GraphShape, ...]:
    """Rectangular speculative programs: at each request bucket, width one (D = 0,
    SPEC-4, SPEC-6) and every eligible wider width with D = W - 1 and ``P = B * W <= R``
    (SPEC-2, SPEC-12). Empty when ``draft_depth`` is 0."""
    if draft_depth <= 0:
        return ()
    shapes = []
    for b in request_buckets(max_batch):
        widths = (1, *eligible_widths(
            b, draft_depth=draft_depth, envelope=envelope,
            completion_token_capacity=completion_token_capacity,
        ))
        for w in widths:
            shapes.append(GraphShape(
                kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                proposal_depth=w - 1, packed_capacity=b * w,
                binding=TargetBinding.QUERY_LENGTH,
            ))
    return tuple(shapes)


def device_allocated_shapes(
    *, max_batch: int, draft_depth: int, envelope: int,
    completion_token_capacity: int = DEFAULT_COMPLETION_TOKEN_CAPACITY,
) -> tuple[GraphShape, ...]:
    """Ragged ``SpeculativePrefixLimit`` programs (SPEC-13, SPEC-22..30): at each request
    bucket ``B >= 2`` and each wider width ``W <= min(D + 1, capacity)``, ``P = B +
    ceil(B * (W - 1) / 2)`` capped by R (no program when the cap leaves no draft row).
    Empty when ``draft_depth`` is 0."""
    if draft_depth <= 0:
        return ()
    shapes = []
    top = min(draft_depth + 1, completion_token_capacity)
    for b in request_buckets(max_batch, minimum=2):
        for w in range(2, top + 1):
            rows = b + -(-b * (w - 1) // 2)
            if envelope > 0:
                rows = min(rows, envelope)
            if rows <= b:
                continue
            shapes.append(GraphShape(
                kind=GraphKind.SPECULATIVE, batch_capacity=b, token_capacity=w,
                proposal_depth=w - 1, packed_capacity=rows,
                binding=TargetBinding.SPECULATIVE_PREFIX_LIMIT,
            ))
    return tuple(shapes)


def check_envelope(shape: GraphShape, envelope: int) -> None:
    """Refuse a speculative or mixed program outside the target-token envelope R:
    rectangular programs need ``B * W <= R`` (SPEC-12), ragged ones ``P <= R``
    (SPEC-13). Width one and ``R = 0`` (no bound) always pass."""
    if envelope <= 0 or shape.token_capacity <= 1:
        return
    if shape.kind is GraphKind.SPECULATIVE:
        rectangular = shape.packed_capacity == shape.batch_capacity * shape.token_capacity
        if rectangular and shape.packed_capacity > envelope:
            raise CatalogError(
                f"{shape.label()}: B*W = {shape.packed_capacity} exceeds R = {envelope} (SPEC-12)"
            )
        if not rectangular and shape.packed_capacity > envelope:
            raise CatalogError(
                f"{shape.label()}: P = {shape.packed_capacity} exceeds R = {envelope} (SPEC-13)"
            )
    elif shape.kind is GraphKind.MIXED:
        rows = shape.batch_capacity * shape.token_capacity
        if rows > envelope:
            raise CatalogError(f"{shape.label()}: B*W = {rows} exceeds R = {envelope} (MIX-41)")


VISION_PROGRAM_IMAGES = 8
"""The most images one vision program encodes (its pixel input is allocated once): a
larger window is encoded by several vision frames."""


def vision_shapes(*, window_images: int, tokens_per_image: int) -> tuple[GraphShape, ...]:
    """Vision programs of 1, 2, 4, ... images, up to ``window_images`` (always
    included; a frame never encodes more than one window, PRE-26, PRE-27) or
    ``VISION_PROGRAM_IMAGES``, whichever is smaller."""
    if window_images < 1 or tokens_per_image < 1:
        raise CatalogError("vision programs need a window of at least one image and "
                           "at least one token per image")
    top = min(window_images, VISION_PROGRAM_IMAGES)
    buckets = {1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top}
    return tuple(GraphShape(kind=GraphKind.VISION, batch_capacity=i,
                            token_capacity=i * tokens_per_image) for i in sorted(buckets))


def state_shapes() -> tuple[GraphShape, ...]:
    """One program per state operation, for one request row (OPEN-39)."""
    return tuple(
        GraphShape(kind=GraphKind.STATE, batch_capacity=1, token_capacity=0, state_op=op)
        for op in StateOp
    )


def fixed_width_shapes(shapes: Iterable[GraphShape]) -> tuple[GraphShape, ...]:
    """Fixed-width mode's subset of a speculative load (MIX-7, LRN-10): per batch bucket
    the speculative and mixed programs of the bucket's widest speculative width,
    everything else as it is. A mixed batch bucket without a wider mixed program of
    that width keeps none. The ordinary decode programs stay for grammar-constrained
    requests, which never speculate (SEL-13): the scheduler offers them no other
    request (``policy.grammar_feedback.fixed_width_contexts``)."""
    shapes = tuple(shapes)
    widest: dict[int, int] = {}
    for s in shapes:
        if s.kind is GraphKind.SPECULATIVE:
            widest[s.batch_capacity] = max(widest.get(s.batch_capacity, 0), s.token_capacity)
    return tuple(s for s in shapes if s.kind not in (GraphKind.SPECULATIVE, GraphKind.MIXED)
                 or s.token_capacity == widest.get(s.batch_capacity))


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogFlags:
    """The flags the catalog follows from (``flare run`` options and the model family)."""

    max_batch: int = 8
    prefill_capacities: tuple[int, ...] = (64, 256, 1024)
    mixed_prefill: bool = False
    family_supports_mixed: bool = False
    """Whether the loaded model family declares mixed capture (CAT-13, OPEN-25)."""
    speculative_token_capacity: int = 0
    """R, bounding aggregate target rows of wider programs; 0 means no bound (SPEC-11)."""
    draft_depth: int = 0
    """Proposal depth D of the loaded draft source; 0 is an ordinary load (MIX-47)."""
    speculative_mixed: bool = True
    """A speculative load's mixed programs above width one (MIX-17, MIX-41, MIX-43). False
    (``flare run --no-speculative-mixed``) keeps only the width-one mixed programs, which
    maintain the draft context (MIX-40, MIX-46), so a frame carrying a prompt chunk
    verifies no drafts: flare's opt-in departure from MIX-43's count."""
    device_allocation: bool = False
    """Add ragged device-allocated (``SpeculativePrefixLimit``) programs to a speculative
    load (``device_allocated_shapes``). Only adaptive selection may run them (SPEC-17):
    the runtime's configuration refuses it in fixed mode."""
    completion_token_capacity: int = DEFAULT_COMPLETION_TOKEN_CAPACITY
    scored_prefill: bool = True
    state_operations: bool = True

    def validate(self) -> None:
        request_buckets(self.max_batch)
        if not self.prefill_capacities:
            raise CatalogError("at least one prefill capacity is needed")
        for c in self.prefill_capacities:
            if c <= 0 or c % PROMPT_ALIGNMENT:
                raise CatalogError(f"prefill capacities must be positive multiples of 64, got {c}")
        if self.speculative_token_capacity < 0:
            raise CatalogError("speculative token capacity R must be non-negative")
        if self.draft_depth < 0:
            raise CatalogError("draft depth must be non-negative")
        if not 1 <= self.completion_token_capacity <= DEFAULT_COMPLETION_TOKEN_CAPACITY:
            raise CatalogError("completion token capacity must be 1..8 (MIX-3)")


@dataclass(frozen=True, slots=True)
class Catalog:
    """The prepared catalog: an ordered tuple of distinct shapes."""

    shapes: tuple[GraphShape, ...]

    def of_kind(self, kind: GraphKind) -> tuple[GraphShape, ...]:
        return tuple(s for s in self.shapes if s.kind is kind)

    @property
    def max_packed_extent(self) -> int:
        """The catalog's maximum packed token extent (MIX-16, MIX-49)."""
        return max((s.max_packed_extent for s in self.shapes), default=0)

    @property
    def max_verification_width(self) -> int:
        """Largest W over separate and mixed programs (MIX-32: state-row reservation)."""
        return max((s.token_capacity for s in self.shapes
                    if s.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE, GraphKind.MIXED)),
                   default=1)

    def labels(self) -> tuple[str, ...]:
        return tuple(s.label() for s in self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self) -> Iterator[GraphShape]:
        return iter(self.shapes)


def build_catalog(flags: CatalogFlags) -> Catalog:
    """Every shape to prepare, in a stable order: decode, prefill, scored prefill,
    mixed, speculative (host-allocated, then device-allocated), state operations."""
    flags.validate()
    capacities = sorted(set(flags.prefill_capacities))
    shapes: list[GraphShape] = [
        GraphShape(kind=GraphKind.DECODE, batch_capacity=b, token_capacity=1, packed_capacity=b)
        for b in request_buckets(flags.max_batch)
    ]
    shapes += [GraphShape(kind=GraphKind.PREFILL, batch_capacity=1, token_capacity=c)
               for c in capacities]
    if flags.scored_prefill:
        shapes += [GraphShape(kind=GraphKind.SCORED_PREFILL, batch_capacity=1, token_capacity=c)
                   for c in capacities]
    if flags.mixed_prefill and flags.family_supports_mixed:
        shapes += mixed_shapes(
            max_batch=flags.max_batch,
            prompt_buckets=prompt_bucket_ladder(capacities[-1]),
            draft_depth=flags.draft_depth,
            envelope=flags.speculative_token_capacity,
            completion_token_capacity=flags.completion_token_capacity,
            wider=flags.speculative_mixed,
        )
    shapes += speculative_shapes(
        max_batch=flags.max_batch, draft_depth=flags.draft_depth,
        envelope=flags.speculative_token_capacity,
        completion_token_capacity=flags.completion_token_capacity,
    )
    if flags.device_allocation:
        shapes += device_allocated_shapes(
            max_batch=flags.max_batch, draft_depth=flags.draft_depth,
            envelope=flags.speculative_token_capacity,
            completion_token_capacity=flags.completion_token_capacity,
        )
    if flags.state_operations:
        shapes += state_shapes()
    return Catalog(tuple(shapes))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDims:
    """The model sizes a workspace estimate needs."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dtype_bytes: int


def workspace_estimate_bytes(extent: int, dims: ModelDims) -> int:
    """Activation workspace for ``extent`` packed tokens, live within one layer:
    residual, normed input, q/k/v, attention output, gate/up/act of the MLP in the
    model dtype, plus fp32 logits for every packed token (scored prefill and
    verification need them all). An estimate for planning, not a measurement."""
    kv = dims.num_key_value_heads * dims.head_dim
    q = dims.num_attention_heads * dims.head_dim
    per_token = dims.dtype_bytes * (3 * dims.hidden_size + q + 2 * kv + 3 * dims.intermediate_size)
    return extent * (per_token + 4 * dims.vocab_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogPlan:
    """The planning report (MIX-48, MIX-49): the catalog, its maximum packed extent,
    the largest verification width, and the workspace the extent needs."""

    catalog: Catalog
    workspace_bytes: int | None

    @property
    def max_packed_extent(self) -> int:
        return self.catalog.max_packed_extent

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for shape in self.catalog:
            counts[shape.kind.value] = counts.get(shape.kind.value, 0) + 1
        return counts

    def to_json(self) -> dict[str, object]:
        return {
            "shapes": list(self.catalog.labels()),
            "counts": self.counts(),
            "max_packed_extent": self.max_packed_extent,
            "max_verification_width": self.catalog.max_verification_width,
            "workspace_bytes_estimate": self.workspace_bytes,
        }

    def summary(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in self.counts().items())
        text = f"catalog: {len(self.catalog)} shapes ({counts}); max packed extent {self.max_packed_extent}"
        if self.workspace_bytes is not None:
            text += f"; activation workspace about {self.workspace_bytes / 2**20:.1f} MiB"
        return text


def plan_catalog(flags: CatalogFlags, dims: ModelDims | None = None) -> CatalogPlan:
    """Build the catalog and its planning report before anything is prepared (MIX-39)."""
    catalog = build_catalog(flags)
    workspace = workspace_estimate_bytes(catalog.max_packed_extent, dims) if dims else None
    return CatalogPlan(catalog=catalog, workspace_bytes=workspace)
