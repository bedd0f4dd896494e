"""The catalog of prepared shapes follows from flags by the seed's rules.

Covers SPEC-2, SPEC-4, SPEC-6, SPEC-10, SPEC-11, SPEC-12, SPEC-13, SPEC-17, SPEC-22, SPEC-24, SPEC-26, CAT-12, CAT-13, MIX-2, MIX-5, MIX-6,
MIX-16, MIX-17, MIX-32, MIX-39, MIX-40, MIX-41, MIX-42, MIX-43, MIX-44, MIX-45, MIX-46, MIX-47, MIX-48, MIX-49 and flare's prompt-bucket ladder (OPEN-26).
"""

from __future__ import annotations

import pytest
from backend_toys import MatmulCounter

from gpu.backends import open_backend
from gpu.catalog import (
    CatalogError,
    CatalogFlags,
    ModelDims,
    balanced_prompt_bucket,
    build_catalog,
    check_envelope,
    eligible_widths,
    mixed_shapes,
    plan_catalog,
    prompt_bucket_ladder,
    request_buckets,
    workspace_estimate_bytes,
)
from policy.descriptors import GraphKind, GraphShape, StateOp, TargetBinding

SEED_EXAMPLE = CatalogFlags(
    max_batch=4, prefill_capacities=(4096,), mixed_prefill=True, family_supports_mixed=True,
    draft_depth=5, speculative_token_capacity=6,
)


def mixed_of(flags: CatalogFlags) -> tuple[GraphShape, ...]:
    return build_catalog(flags).of_kind(GraphKind.MIXED)


def test_spec_10_decode_at_every_power_of_two_bucket() -> None:
    catalog = build_catalog(CatalogFlags(max_batch=16))
    assert [s.batch_capacity for s in catalog.of_kind(GraphKind.DECODE)] == [1, 2, 4, 8, 16]
    assert all(s.token_capacity == 1 for s in catalog.of_kind(GraphKind.DECODE))
    assert request_buckets(64)[-1] == 64
    for bad in (0, 6, 128):
        with pytest.raises(CatalogError, match="power of two"):
            request_buckets(bad)


def test_prefill_and_scored_prefill_at_each_capacity() -> None:
    """MIX-5: non-mixed programs have prefill_capacity 0; capacities are multiples of 64."""
    catalog = build_catalog(CatalogFlags(prefill_capacities=(256, 64, 1024)))
    for kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        assert [s.token_capacity for s in catalog.of_kind(kind)] == [64, 256, 1024]
    assert all(s.prefill_capacity == 0 for s in catalog if s.kind is not GraphKind.MIXED)
    with pytest.raises(CatalogError, match="multiples of 64"):
        build_catalog(CatalogFlags(prefill_capacities=(100,)))
    assert not build_catalog(CatalogFlags(scored_prefill=False)).of_kind(GraphKind.SCORED_PREFILL)


def test_state_operations_one_row_each() -> None:
    catalog = build_catalog(CatalogFlags())
    assert {s.state_op for s in catalog.of_kind(GraphKind.STATE)} == set(StateOp)
    assert len(set(catalog.shapes)) == len(catalog)


def test_cat_12_no_mixed_without_the_flag() -> None:
    flags = CatalogFlags(mixed_prefill=False, family_supports_mixed=True, draft_depth=5)
    assert mixed_of(flags) == ()


def test_cat_13_no_mixed_for_a_family_without_mixed_capture() -> None:
    flags = CatalogFlags(mixed_prefill=True, family_supports_mixed=False)
    assert mixed_of(flags) == ()
    assert mixed_of(CatalogFlags(mixed_prefill=True, family_supports_mixed=True))


def test_open_26_prompt_bucket_ladder() -> None:
    """Powers of two from 64, 3 * 2**k steps from 768, the largest capacity always in."""
    assert prompt_bucket_ladder(4096) == (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert prompt_bucket_ladder(1024) == (64, 128, 256, 512, 768, 1024)
    assert prompt_bucket_ladder(64) == (64,)
    assert prompt_bucket_ladder(320) == (64, 128, 256, 320)
    with pytest.raises(CatalogError):
        prompt_bucket_ladder(100)


def test_mix_45_seed_example_22_speculative_and_20_ordinary() -> None:
    """Concurrency four, 4096-token chunks, five drafts, envelope six (OPEN-26 reading)
    give 22 speculative and 20 ordinary mixed programs; R = 7 gives the same."""
    assert len(mixed_of(SEED_EXAMPLE)) == 22
    assert len(mixed_of(_replace(SEED_EXAMPLE, speculative_token_capacity=7))) == 22
    assert len(mixed_of(_replace(SEED_EXAMPLE, draft_depth=0))) == 20


def test_mix_6_44_47_speculation_variant_matches_the_load() -> None:
    speculative = mixed_of(SEED_EXAMPLE)
    ordinary = mixed_of(_replace(SEED_EXAMPLE, draft_depth=0))
    assert all(s.speculation_enabled for s in speculative)
    assert any(s.token_capacity == 1 for s in speculative)  # W=1 keeps draft state
    assert not any(s.speculation_enabled for s in ordinary)
    assert all(s.token_capacity == 1 and s.proposal_depth == 0 for s in ordinary)


def test_mix_2_40_every_batch_bucket_has_every_prompt_bucket_at_width_one() -> None:
    flags = CatalogFlags(max_batch=16, prefill_capacities=(64, 2048), mixed_prefill=True,
                         family_supports_mixed=True)
    shapes = mixed_of(flags)
    ladder = prompt_bucket_ladder(2048)
    assert {s.batch_capacity for s in shapes} == {2, 4, 8, 16}
    for b in (2, 4, 8, 16):
        widths_one = sorted(s.prefill_capacity for s in shapes
                            if s.batch_capacity == b and s.token_capacity == 1)
        assert widths_one == list(ladder)


def test_mix_41_balanced_prompt_bucket() -> None:
    powers = [64 * 2**k for k in range(7)]  # 64..4096
    assert balanced_prompt_bucket(powers) == 512
    assert balanced_prompt_bucket([p for p in powers if p <= 2048]) == 256  # tie -> smaller
    assert balanced_prompt_bucket(prompt_bucket_ladder(4096)) == 512
    wide = [s for s in mixed_of(SEED_EXAMPLE) if s.token_capacity > 1]
    assert {(s.batch_capacity, s.token_capacity, s.prefill_capacity) for s in wide} == {
        (2, 2, 512), (2, 3, 512)}


def test_spec_12_mix_41_envelope_bounds_batch_times_width() -> None:
    assert eligible_widths(2, draft_depth=5, envelope=6, completion_token_capacity=8) == (2, 3)
    assert eligible_widths(4, draft_depth=5, envelope=6, completion_token_capacity=8) == ()
    assert eligible_widths(1, draft_depth=9, envelope=0, completion_token_capacity=8) == tuple(
        range(2, 9))  # MIX-3: width capped by the completion token capacity


@pytest.mark.parametrize(("max_batch", "depth", "envelope", "largest"),
                         [(8, 3, 0, 1024), (16, 7, 24, 2048), (2, 1, 0, 64), (64, 4, 32, 512)])
def test_mix_43_count_is_buckets_times_prompt_buckets_plus_widths(
    max_batch: int, depth: int, envelope: int, largest: int,
) -> None:
    ladder = prompt_bucket_ladder(largest)
    shapes = mixed_shapes(max_batch=max_batch, prompt_buckets=ladder, draft_depth=depth,
                          envelope=envelope)
    expected = sum(
        len(ladder) + len(eligible_widths(b, draft_depth=depth, envelope=envelope,
                                          completion_token_capacity=8))
        for b in request_buckets(max_batch, minimum=2)
    )
    assert len(shapes) == expected
    assert len(set(shapes)) == len(shapes)


def test_mix_16_17_49_packed_extent() -> None:
    shape = GraphShape(kind=GraphKind.MIXED, batch_capacity=4, token_capacity=6,
                       prefill_capacity=128, packed_capacity=146)
    assert shape.max_packed_extent == 146
    shapes = mixed_of(SEED_EXAMPLE)
    for s in shapes:
        assert s.prefill_capacity >= s.token_capacity  # MIX-17
        assert s.packed_capacity == s.prefill_capacity + (s.batch_capacity - 1) * s.token_capacity
    catalog = build_catalog(SEED_EXAMPLE)
    assert catalog.max_packed_extent == 4096 + 3 * 1  # (B=4, W=1, P=4096)
    dims = ModelDims(hidden_size=256, intermediate_size=768, vocab_size=4096,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, dtype_bytes=4)
    plan = plan_catalog(SEED_EXAMPLE, dims)
    assert plan.max_packed_extent == catalog.max_packed_extent
    assert plan.workspace_bytes == workspace_estimate_bytes(4099, dims)
    assert workspace_estimate_bytes(8198, dims) == 2 * workspace_estimate_bytes(4099, dims)
    assert plan.to_json()["max_packed_extent"] == 4099


def test_spec_2_4_6_11_12_separate_speculative_programs() -> None:
    catalog = build_catalog(CatalogFlags(max_batch=8, draft_depth=3,
                                         speculative_token_capacity=6))
    spec = catalog.of_kind(GraphKind.SPECULATIVE)
    assert {s.batch_capacity for s in spec if s.token_capacity == 1} == {1, 2, 4, 8}  # SPEC-6
    for s in spec:
        assert s.packed_capacity == s.batch_capacity * s.token_capacity  # SPEC-2
        assert s.binding is TargetBinding.QUERY_LENGTH
        if s.token_capacity == 1:
            assert s.proposal_depth == 0  # SPEC-4
        else:
            assert s.batch_capacity * s.token_capacity <= 6  # SPEC-12
    assert {(s.batch_capacity, s.token_capacity) for s in spec if s.token_capacity > 1} == {
        (1, 2), (1, 3), (1, 4), (2, 2), (2, 3)}
    assert not build_catalog(CatalogFlags(max_batch=8)).of_kind(GraphKind.SPECULATIVE)
    assert catalog.max_verification_width == 4  # MIX-32


def test_mix_39_48_preparation_covers_exactly_the_catalog() -> None:
    """The catalog is computed first; preparation covers exactly it, largest first."""
    catalog = build_catalog(_replace(SEED_EXAMPLE, prefill_capacities=(64, 512)))
    backend = open_backend("fake")
    try:
        report = backend.prepare([MatmulCounter(s) for s in catalog])
    finally:
        backend.close()
    assert sorted(report.catalog, key=repr) == sorted(catalog.shapes, key=repr)
    extents = [s.max_packed_extent for s in report.catalog]
    assert extents == sorted(extents, reverse=True)
    assert report.max_packed_extent == catalog.max_packed_extent


def _replace(flags: CatalogFlags, **changes: object) -> CatalogFlags:
    import dataclasses

    return dataclasses.replace(flags, **changes)  # type: ignore[arg-type]


def test_spec_12_13_envelope_check_refuses_programs_beyond_r() -> None:
    rect = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=2,
                      proposal_depth=1, packed_capacity=8, binding=TargetBinding.QUERY_LENGTH)
    ragged = GraphShape(kind=GraphKind.SPECULATIVE, batch_capacity=4, token_capacity=4,
                        proposal_depth=3, packed_capacity=7,
                        binding=TargetBinding.SPECULATIVE_PREFIX_LIMIT)
    with pytest.raises(CatalogError, match="SPEC-12"):
        check_envelope(rect, 6)
    with pytest.raises(CatalogError, match="SPEC-13"):
        check_envelope(ragged, 6)
    check_envelope(ragged, 7)
    check_envelope(rect, 0)  # no bound
    for shape in build_catalog(_replace(SEED_EXAMPLE, max_batch=8)):
        check_envelope(shape, 6)  # everything the catalog generates fits its own R


def test_spec_13_22_26_device_allocation_adds_ragged_prefix_limit_programs() -> None:
    """Adaptive loads with device allocation: at every bucket B >= 2 and every wider
    width, one ragged ``SpeculativePrefixLimit`` program with P = B + ceil(B(W-1)/2)
    (each lane's pending row plus half the draft rows), capped by R (SPEC-13); the
    host-allocated rectangular programs stay beside them."""
    host = build_catalog(CatalogFlags(max_batch=8, draft_depth=4))
    both = build_catalog(CatalogFlags(max_batch=8, draft_depth=4, device_allocation=True))
    device = [s for s in both if s.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT]
    assert not [s for s in host if s.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT]
    assert [s for s in both if s not in device] == list(host.shapes)
    assert {(s.batch_capacity, s.token_capacity, s.packed_capacity) for s in device} == {
        (b, w, b + -(-b * (w - 1) // 2)) for b in (2, 4, 8) for w in (2, 3, 4, 5)}
    for s in device:
        assert s.kind is GraphKind.SPECULATIVE and s.proposal_depth == s.token_capacity - 1
        # ragged: every lane keeps its pending row (SPEC-24), fewer rows than B*W, so
        # lane ceilings may sum above P (SPEC-26)
        assert s.batch_capacity < s.packed_capacity < s.batch_capacity * s.token_capacity
    assert (8, 5, 24) in {(s.batch_capacity, s.token_capacity, s.packed_capacity)
                          for s in device}
    # R caps P (SPEC-13) and drops programs left without a draft row
    capped = build_catalog(CatalogFlags(max_batch=8, draft_depth=4, device_allocation=True,
                                        speculative_token_capacity=8))
    capped_device = [s for s in capped if s.binding is TargetBinding.SPECULATIVE_PREFIX_LIMIT]
    assert {(s.batch_capacity, s.token_capacity, s.packed_capacity) for s in capped_device} == {
        (2, 2, 3), (2, 3, 4), (2, 4, 5), (2, 5, 6), (4, 2, 6), (4, 3, 8), (4, 4, 8), (4, 5, 8)}
    for shape in capped:
        check_envelope(shape, 8)
    # an ordinary load has no speculative programs at all
    assert not build_catalog(CatalogFlags(max_batch=8, device_allocation=True)).of_kind(
        GraphKind.SPECULATIVE)


def test_spec_17_device_allocation_is_a_flare_run_flag_for_adaptive_mode_only() -> None:
    """``flare run --speculative-allocation device`` reaches the runtime configuration;
    fixed-width selection with device allocation is refused before loading (SPEC-17)."""
    from actors.config import DEFAULT_MODEL_DIR, ConfigError
    from ops.cli import build_parser
    from ops.run_command import build_runtime_config

    def config_of(*flags: str) -> object:
        argv = ["run", "--model", str(DEFAULT_MODEL_DIR), "--draft-source", "copy", *flags]
        return build_runtime_config(build_parser(argv).parse_args(argv))

    adaptive = config_of("--speculative-allocation", "device")
    assert adaptive.speculation == "adaptive"  # type: ignore[attr-defined]
    assert adaptive.speculative_allocation == "device"  # type: ignore[attr-defined]
    adaptive.validate()  # type: ignore[attr-defined]
    assert config_of().speculative_allocation == "host"  # type: ignore[attr-defined]
    fixed = config_of("--speculation", "fixed", "--speculative-allocation", "device")
    with pytest.raises(ConfigError, match="adaptive"):
        fixed.validate()  # type: ignore[attr-defined]


def test_spec_22_the_runtime_catalog_prepares_device_allocated_programs() -> None:
    """The catalog the runtime builds from its configuration (adaptive, device
    allocation, the embedded default model with copy proposals) contains the ragged
    ``SpeculativePrefixLimit`` programs, and the engine prepares a device-allocating
    program for each; host allocation leaves them out."""
    import dataclasses

    from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
    from actors.system import _load_engine
    from gpu.catalog import device_allocated_shapes

    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        pytest.skip("the default model is not committed")
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, max_batch=4, prefill_capacities=(64,),
                           speculation="adaptive", draft_source="copy", draft_depth=2,
                           speculative_allocation="device", max_context=256)
    config.validate()
    engine, shapes = _load_engine(config, "cpu")
    expected = device_allocated_shapes(max_batch=4, draft_depth=2, envelope=0)
    assert expected and set(expected) <= set(shapes)
    for shape in expected:
        assert engine.programs[shape].device_allocation  # type: ignore[attr-defined]
    _, host_shapes = _load_engine(dataclasses.replace(config, speculative_allocation="host"),
                                  "cpu")
    assert not set(expected) & set(host_shapes)
