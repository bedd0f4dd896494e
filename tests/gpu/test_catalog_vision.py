"""The vision programs a vision-language load serves (``gpu.catalog.vision_shapes``,
added by ``actors.catalog_setup.served_shapes``)."""

from __future__ import annotations

from dataclasses import replace

from actors.catalog_setup import served_shapes
from actors.config import RuntimeConfig
from gpu.catalog import CatalogFlags, build_catalog, vision_shapes
from policy import GraphKind


def test_a_vision_checkpoint_on_the_cpu_serves_vision_programs() -> None:
    """Covers CAT-9: a vision-language load serves vision programs of 1, 2, 4, ... images
    up to one window (``--vision-feature-images``) or eight; a text checkpoint and the
    CUDA backend (which refuses image frames) serve none."""

    class Tower:
        tokens_per_image = 576

    base = build_catalog(CatalogFlags(max_batch=2, prefill_capacities=(64,))).shapes
    config = RuntimeConfig(model_dir="m", vision_feature_images=6)
    served = served_shapes(base, config, Tower())  # type: ignore[arg-type]
    assert [s for s in served if s.kind is GraphKind.VISION] == list(
        vision_shapes(window_images=6, tokens_per_image=576))
    assert [s.batch_capacity for s in vision_shapes(window_images=6, tokens_per_image=576)] \
        == [1, 2, 4, 6]
    assert all(s.token_capacity == 576 * s.batch_capacity
               for s in vision_shapes(window_images=8, tokens_per_image=576))
    # a larger window takes several frames of at most eight images
    assert [s.batch_capacity for s in vision_shapes(window_images=100, tokens_per_image=1)] \
        == [1, 2, 4, 8]
    assert served_shapes(base, config) == base
    cuda = replace(config, backend="cuda")
    assert served_shapes(base, cuda, Tower()) == base  # type: ignore[arg-type]
