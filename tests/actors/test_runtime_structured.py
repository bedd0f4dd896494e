"""Structured output in a shared batch on the real runtime (CPU backend, the embedded
model): constrained and unconstrained requests decode in the same frames, ordinary and
mixed, and the mask touches only its own lane, with grammars resident in the device
process or on an in-thread stream, or kept on the host. Covers QUEUE-13 (host grammars:
the constrained requests' plans wait for feedback; resident grammars: their decode
frames queue behind one another, flare's extension), and their outputs still follow
the grammar token by token, first tokens included, sampled by prompt lanes of mixed
frames, OPEN-22."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jsonschema
import pytest
import trio

from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
from actors.errors import InvalidRequest
from actors.public import Finished, GenerationRequest, GrammarSpec, SamplingParams, TokenDelta
from actors.system import Runtime, open_runtime
from ops import cli
from ops.run_command import build_runtime_config

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["x", "y"]},
    "words": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["id", "kind", "words"], "additionalProperties": False}


def _constrained(prompt: tuple[int, ...], seed: int) -> GenerationRequest:
    """A seeded request constrained to ``SCHEMA`` (it stops when the record closes)."""
    return GenerationRequest(prompt_token_ids=prompt, max_tokens=120,
                             sampling=SamplingParams(temperature=1.0, seed=seed),
                             grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))


async def _run(rt: Runtime, request: GenerationRequest) -> tuple[list[int], str, Finished]:
    tokens: list[int] = []
    text: list[str] = []
    final = None
    async with rt.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
                text.append(event.text)
            elif isinstance(event, Finished):
                final = event
    assert final is not None
    return tokens, "".join(text), final


@pytest.mark.parametrize(("mixed", "resident", "device_process"), [
    (False, True, True), (True, True, True), (False, False, True), (True, True, False)],
    ids=["decode", "mixed", "host-grammars", "mixed-in-thread"])
async def test_constrained_and_free_requests_share_frames(
        mixed: bool, resident: bool, device_process: bool) -> None:
    """A seeded unconstrained request samples the same tokens alone and next to three
    constrained ones (the mask is per lane), while every constrained output validates
    against its schema and ends with ``stop``."""
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, max_batch=4, capture_forward=False,
                           prefill_capacities=(64,), mixed_prefill=mixed,
                           resident_grammars=resident, device_process=device_process)
    with trio.fail_after(300):
        async with open_runtime(config) as rt:
            prompt = tuple(rt.codec.encode("Write a record:"))
            free = GenerationRequest(prompt_token_ids=prompt, max_tokens=48, ignore_eos=True,
                                     sampling=SamplingParams(temperature=1.0, seed=41))
            alone, _, _ = await _run(rt, free)
            results: dict[int, tuple[list[int], str, Finished]] = {}

            async def one(index: int, request: GenerationRequest) -> None:
                results[index] = await _run(rt, request)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, free)
                for seed in (1, 2, 3):
                    nursery.start_soon(one, seed, _constrained(prompt, seed))
            graphs = dict(rt.statistics().executions_by_graph)
    assert any(g.startswith("mixed") for g in graphs) is mixed, graphs
    assert results[0][0] == alone
    for seed in (1, 2, 3):
        _, text, final = results[seed]
        assert final.reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def _queued_decodes(rt: Runtime) -> int:
    """Decode frames launched while the decode frame before them was still running."""
    log = [r for r in rt.frame_log() if r.graph.startswith("decode")]
    return sum(b.launched_ns < a.observed_ns for a, b in itertools.pairwise(log))


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "host"])
async def test_resident_grammars_let_constrained_decodes_queue(resident: bool) -> None:
    """Covers QUEUE-13 (host grammars) and flare's extension for resident ones: a lone
    constrained request's decode frames never overlap with host grammars (each waits
    for the previous token), and do queue behind one another with resident grammars;
    the output validates either way."""
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, max_batch=2, capture_forward=False,
                           prefill_capacities=(64,), resident_grammars=resident)
    with trio.fail_after(300):
        async with open_runtime(config) as rt:
            prompt = tuple(rt.codec.encode("Write a record:"))
            _, text, final = await _run(rt, _constrained(prompt, 5))
            queued = _queued_decodes(rt)
    assert final.reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert (queued > 0) is resident, queued


@pytest.mark.parametrize(("flags", "resident"), [([], True), (["--host-grammars"], False)])
def test_the_host_grammars_flag_reaches_the_runtime_config(
        tmp_path: Path, flags: list[str], resident: bool) -> None:
    argv = ["run", "--model", str(tmp_path), *flags]
    config = build_runtime_config(cli.build_parser(argv).parse_args(argv))
    assert config.resident_grammars is resident


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
async def test_resident_grammars_hold_under_speculation(mixed: bool) -> None:
    """Covers SEL-13 and QUEUE-13 (resident extension) in a speculative load: the
    programs that keep the draft context current declare the resident grammars of the
    programs they wrap, so constrained decodes use them (their frames queue behind one
    another, which host grammars never allow) and every constrained output follows its
    grammar while an unconstrained request runs beside them (whether adaptive
    speculation chooses rounds for it depends on measured durations, so the test does
    not ask that it does)."""
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, max_batch=4, capture_forward=False,
                           prefill_capacities=(64,), mixed_prefill=mixed,
                           speculation="adaptive", draft_source="copy", draft_depth=2)
    with trio.fail_after(300):
        async with open_runtime(config) as rt:
            prompt = tuple(rt.codec.encode("Write a record:"))
            _, text, alone = await _run(rt, _constrained(prompt, 5))
            queued = _queued_decodes(rt)
            results: dict[int, tuple[list[int], str, Finished]] = {}

            async def one(index: int, request: GenerationRequest) -> None:
                results[index] = await _run(rt, request)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, GenerationRequest(
                    prompt_token_ids=prompt * 4, max_tokens=48, ignore_eos=True))
                for seed in (1, 2, 3):
                    nursery.start_soon(one, seed, _constrained(prompt, seed))
    assert alone.reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert queued > 0, queued
    for seed in (1, 2, 3):
        _, text, final = results[seed]
        assert final.reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_constrained_requests_are_served_under_fixed_width_speculation() -> None:
    """Covers SEL-13 under fixed-width speculation (MIX-7, flare's reading): the
    fixed-width catalog keeps the plain decode programs and only constrained requests
    run on them, so a lone constrained request finishes on plain decodes, and beside an
    unconstrained request every output follows its grammar while the unconstrained one
    decodes in complete rounds."""
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, max_batch=2, capture_forward=False,
                           prefill_capacities=(64,), speculation="fixed",
                           draft_source="copy", draft_depth=2)
    with trio.fail_after(300):
        async with open_runtime(config) as rt:
            prompt = tuple(rt.codec.encode("Write a record:"))
            _, text, alone = await _run(rt, _constrained(prompt, 5))
            lone = dict(rt.statistics().executions_by_graph)
            results: dict[int, tuple[list[int], str, Finished]] = {}

            async def one(index: int, request: GenerationRequest) -> None:
                results[index] = await _run(rt, request)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, GenerationRequest(
                    prompt_token_ids=prompt * 4, max_tokens=24, ignore_eos=True))
                nursery.start_soon(one, 1, _constrained(prompt, 1))
            graphs = dict(rt.statistics().executions_by_graph)
    assert alone.reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert any(g.startswith("decode") for g in lone), lone
    assert not any(g.startswith("spec") for g in lone), lone
    assert any(g.startswith("spec") for g in graphs), graphs
    assert len(results[0][0]) == 24 and results[0][2].reason == "length"
    _, text, final = results[1]
    assert final.reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_constrained_requests_are_refused_where_every_decode_speculates() -> None:
    """Covers SEL-13: a fixed-spec baseline runs every decode on speculative rows, so a
    constrained request could never be planned and admission refuses it (a 400 over
    HTTP) instead of leaving it waiting; an unconstrained request is still served."""
    config = RuntimeConfig(model_dir=DEFAULT_MODEL_DIR, max_batch=2, capture_forward=False,
                           prefill_capacities=(64,), speculation="adaptive",
                           draft_source="copy", draft_depth=2, scheduler_policy="fixed-spec-2")
    with trio.fail_after(120):
        async with open_runtime(config) as rt:
            prompt = tuple(rt.codec.encode("Write a record:"))
            with pytest.raises(InvalidRequest, match="structured output is not available"):
                await _run(rt, GenerationRequest(
                    prompt_token_ids=prompt, max_tokens=16,
                    grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))))
            tokens, _, final = await _run(rt, GenerationRequest(
                prompt_token_ids=prompt, max_tokens=8, ignore_eos=True))
    assert len(tokens) == 8 and final.reason == "length"
