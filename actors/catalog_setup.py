"""How large the runtime's resources are, and which of the generated catalog it serves.

``open_runtime`` sizes the allocator from these rules: the shapes the configured
speculation mode runs, with a vision-language checkpoint's vision programs
(``served_shapes``), the scratch rows terminal snapshots need
(``snapshot_lanes``), the request-state rows (``state_rows_for``), the prepared batch
buckets for a batch limit that is no power of two (``program_batch``) and the default
KV page count (``default_pages``).
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.config import RuntimeConfig
from actors.page_pool import pages_for
from gpu import VisionConfig, fixed_width_shapes, vision_shapes
from policy import GraphKind, GraphShape, StateOp


def served_shapes(shapes: Sequence[GraphShape], config: RuntimeConfig,
                  vision: VisionConfig | None = None) -> tuple[GraphShape, ...]:
    """The generated catalog less what the configured mode does not run.

    A speculative load serves every ``speculation_enabled`` mixed program: width one
    keeps the draft context (MIX-6) and the wider ones carry speculative decode rows,
    which the speculating ``Scheduler`` plans (``MixedRole.decode_mode`` SPECULATIVE).
    Fixed-width mode (MIX-7, LRN-10) keeps, per batch bucket, only the programs of
    the fixed width ``D + 1`` (the widest speculative width the envelope allows at
    that bucket), mixed and separate speculative alike: every unconstrained decode row
    is verified at that width, so width-one mixed programs go (a mixed batch bucket
    without a wider mixed program of that width keeps none). The ordinary decode
    programs stay: grammar-constrained requests, which never speculate, decode on them
    (SEL-13) and no other request does (``policy.grammar_feedback``).

    A vision-language checkpoint (``vision``) on the CPU backend adds its vision
    programs (``gpu.catalog.vision_shapes``, up to one window of
    ``--vision-feature-images``): the scheduler runs vision as a prerequisite frame
    (``policy.vision_prerequisites``). CUDA refuses image frames, so it has none."""
    kept = list(shapes)
    kept += [s for s in config.extra_speculative_shapes if s not in kept]
    if vision is not None and config.backend == "cpu":
        kept += vision_shapes(window_images=config.vision_feature_images,
                              tokens_per_image=vision.tokens_per_image)
    if config.speculation != "fixed":
        return tuple(kept)
    return fixed_width_shapes(kept)


def snapshot_lanes(catalog: Sequence[GraphShape]) -> int:
    """Scratch rows the allocator keeps for terminal snapshots: the widest SNAPSHOT
    shape's lanes (0 without one: then the scheduler plans no terminal lanes)."""
    return max((s.batch_capacity for s in catalog
                if s.kind is GraphKind.STATE and s.state_op is StateOp.SNAPSHOT), default=0)


def program_batch(max_batch: int) -> int:
    """The largest prepared batch bucket for a batch limit: ``max_batch`` rounded up to
    a power of two (decode programs come in power-of-two buckets)."""
    return 1 << (max_batch - 1).bit_length()


def state_rows_for(max_batch: int) -> int:
    """Request state rows. A power-of-two limit: twice the largest batch, so a decode
    batch can run while as many requests more are resident (prefilling, or waiting
    for their fenced release). Any other limit N: N rows, so no more than N requests
    are ever resident and no decode batch exceeds N, although the largest prepared
    bucket (``program_batch``) is larger."""
    if program_batch(max_batch) != max_batch:
        return max_batch
    return 2 * max_batch


def default_pages(max_batch: int, max_context: int, page_size: int) -> int:
    """Enough pages for ``max_batch`` full contexts."""
    return max_batch * pages_for(max_context, page_size)
