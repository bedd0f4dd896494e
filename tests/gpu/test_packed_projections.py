"""Packed projections (``gpu.model.linear``): a CPU float32 decoder runs every
projection through a oneDNN-packed weight, with results as ``F.linear``'s up to
rounding, rows independent of their batch, and the packed copies rebuilt from their
dense weights when programs move into a device process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import build_checkpoint, build_engine

from gpu.backends.rank_programs import held_bytes, model_parts, pack_projections
from gpu.backends.shared_pickling import dumps_shared, loads_shared
from gpu.model.decoder import Decoder
from gpu.model.linear import PACKING_ENV, pack, packed_linear, packs_projections, source


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # q/k/v biases and untied logits: every kind of projection the decoder packs
    return build_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def test_a_cpu_float32_decoder_packs_every_projection_at_its_first_forward(
        qwen2_dir: Path) -> None:
    engine = build_engine(qwen2_dir)
    decoder = engine.parts.decoder
    # a process that only holds the programs (a server handing them to its device
    # process) holds no packed copy
    assert decoder.packed == {}
    assert held_bytes(list(engine.programs.values()))["packed"] == 0
    x = torch.randn(5, decoder.config.hidden_size)
    logits = decoder.logits(x)
    layers = decoder.config.num_layers
    assert set(decoder.packed) == {"lm_head", *(
        name for i in range(layers) for name in (
            f"qkv.{i}", f"gate_up.{i}", f"model.layers.{i}.self_attn.o_proj.weight",
            f"model.layers.{i}.mlp.down_proj.weight"))}
    assert all(p.is_mkldnn for p in decoder.packed.values())
    assert source(decoder.packed["lm_head"]) is decoder.lm_head
    # the memory report counts the copies beside the parameters
    held = held_bytes(list(engine.programs.values()))
    assert held["packed"] == 4 * sum(p.numel() for p in decoder.packed.values()) > 0
    torch.testing.assert_close(logits, F.linear(x, decoder.lm_head))
    torch.testing.assert_close(decoder._project(x, "qkv.0", decoder.qkv_weight[0],
                                                decoder.qkv_bias[0]),
                               F.linear(x, decoder.qkv_weight[0], decoder.qkv_bias[0]))


def test_packing_is_for_cpu_float32_and_can_be_turned_off(
        qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert packs_projections("cpu", torch.float32)
    assert not packs_projections("cpu", torch.bfloat16)
    assert not packs_projections("meta", torch.float32)
    monkeypatch.setenv(PACKING_ENV, "0")
    assert not packs_projections("cpu", torch.float32)
    assert build_engine(qwen2_dir).parts.decoder.packed == {}


def test_a_rows_product_does_not_depend_on_the_rest_of_its_batch() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packed, rows = pack(weight), torch.randn(8, 64)
    batch = packed_linear(rows, packed, bias)
    torch.testing.assert_close(batch, F.linear(rows, weight, bias))
    for i in range(rows.shape[0]):
        assert torch.equal(batch[i:i + 1], packed_linear(rows[i:i + 1].clone(), packed, bias))


@pytest.mark.filterwarnings("ignore:.*torch.jit.trace:DeprecationWarning")
def test_a_traced_call_runs_the_same_product() -> None:
    torch.manual_seed(1)
    weight, x = torch.randn(48, 32), torch.randn(4, 32)
    packed = pack(weight)
    traced = torch.jit.trace(lambda a, p: packed_linear(a, p) * 2, (x, packed),  # type: ignore[no-untyped-call]
                             check_trace=False)
    assert "_linear_pointwise" in str(traced.graph)
    assert torch.equal(traced(x, packed), packed_linear(x, packed) * 2)


def test_packed_weights_move_as_their_dense_weights_and_are_packed_again(
        qwen2_dir: Path) -> None:
    decoder = build_engine(qwen2_dir).parts.decoder
    x = torch.randn(3, decoder.config.hidden_size)
    expected = decoder.logits(x)  # packs
    moved = loads_shared(dumps_shared(decoder))
    assert set(moved.packed) == set(decoder.packed)
    assert all(p.is_mkldnn and p is not decoder.packed[name]
               for name, p in moved.packed.items())
    # each copy is packed again from the moved decoder's own (shared) dense weight
    assert source(moved.packed["lm_head"]) is moved.lm_head
    assert torch.equal(moved.logits(x), expected)


def test_a_device_process_packs_the_programs_it_receives(qwen2_dir: Path) -> None:
    engine = build_engine(qwen2_dir)
    moved = loads_shared(dumps_shared(list(engine.programs.values())))
    assert held_bytes(moved)["packed"] == 0  # nothing packed travelled
    pack_projections(moved)
    decoders = [part for part in model_parts(moved) if isinstance(part, Decoder)]
    assert decoders and all(d.packed for d in decoders)
    assert held_bytes(moved)["packed"] > 0
