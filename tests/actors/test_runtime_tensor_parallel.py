"""The runtime on two tensor-parallel ranks (``--tensor-parallel-size 2``, gloo on the
CPU): every frame runs on both device processes, each with its shard of the model and
of the KV pool, and rank zero's outputs are served once the ranks agree (ACC-16).

- greedy output over HTTP equals one rank's (and transformers') token for token, on the embedded model
  (4 heads, 2 KV heads: one KV head per rank) and on a tiny random GQA checkpoint with
  one KV head (replicated on both ranks); seeded sampling too, copy speculation and
  learned-draft speculation (its rounds' identities, consumption and emitted prefixes
  agree across the ranks);
- a rank killed mid-load fails the requests in flight and later ones with an error
  naming the lost rank, the runtime reports the fault (``/health``), and shutdown
  leaves no device process behind (OPEN-37).

Two ranks on a 2-core machine: tiny models, few tokens.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from actors.config import DEFAULT_MODEL_DIR
from actors.public import Finished, GenerationRequest, SamplingParams, TokenDelta
from actors.system import Runtime, open_runtime
from gpu.backends.rank_programs import held_bytes
from ops.testing import serve_app
from tests.actors.reference import hf_greedy
from tests.actors.test_runtime_cpu import config_for, prompt_of
from tests.actors.test_runtime_device_process import device_processes, run_request

DEADLINE_S = 120.0
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=7)
UNBOUNDED_TOKENS = 200
"""A request limit the speculation test reads far less of (context 256)."""


async def tokens_of(rt: Runtime, prompt: list[int], max_tokens: int,
                    sampling: SamplingParams = GREEDY, *, read: int | None = None
                    ) -> list[int]:
    """The request's tokens; with ``read``, only its first ``read`` tokens, leaving
    (withdrawing the request) once they have arrived."""
    tokens: list[int] = []
    request = GenerationRequest(prompt_token_ids=tuple(prompt), max_tokens=max_tokens,
                                sampling=sampling, ignore_eos=True)
    async with rt.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
                if read is not None and len(tokens) >= read:
                    return tokens[:read]
            elif isinstance(event, Finished):
                assert event.reason == "length", event.message
    return tokens


async def runs(model_dir: Path, tp: int, prompts: list[list[int]], max_tokens: int,
               samplings: tuple[SamplingParams, ...], *, read: int | None = None,
               **kw: object) -> list[list[list[int]]]:
    """Per sampling setting, per prompt: the tokens one runtime on ``tp`` ranks gives
    (the first ``read`` of them, when given)."""
    config = config_for(model_dir, capture_forward=False, tensor_parallel_size=tp,
                        device_process=tp > 1, **kw)
    async with open_runtime(config) as rt:
        return [[await tokens_of(rt, p, max_tokens, s, read=read) for p in prompts]
                for s in samplings]


async def test_two_ranks_serve_the_embedded_model_as_one_over_http() -> None:
    """OPEN-37, ACC-16: greedy completions over HTTP on two ranks equal one rank's.
    The model's memory is divided: the serving process holds no parameter and no KV
    page, each rank half the KV pool (one of the two KV heads) and less than the
    whole model; each holds its projections' packed copies, the serving process none."""
    prompts = ["def add(a, b):", "import os\n"]
    texts: dict[int, list[str]] = {}
    held: dict[int, tuple[dict[str, int], ...]] = {}
    with trio.fail_after(DEADLINE_S):
        for tp in (1, 2):
            config = config_for(DEFAULT_MODEL_DIR, capture_forward=False, max_context=128,
                                tensor_parallel_size=tp, device_process=True)
            async with open_runtime(config) as rt, serve_app(rt) as server, \
                    httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
                held[tp] = getattr(rt._parts.backend, "held_bytes")  # noqa: B009
                if tp == 1:  # the device process packs, the serving process does not
                    assert held_bytes(list(rt._parts.programs.values()))["packed"] == 0
                if tp > 1:  # the serving process's programs hold placeholders only
                    assert held_bytes(list(rt._parts.programs.values())) == {
                        "weights": 0, "packed": 0, "kv": 0}
                texts[tp] = []
                for prompt in prompts:
                    reply = await client.post("/v1/completions", json={
                        "model": rt.model_name, "prompt": prompt, "max_tokens": 8,
                        "temperature": 0, "ignore_eos": True})
                    assert reply.status_code == 200, reply.text
                    texts[tp].append(reply.json()["choices"][0]["text"])
                health = await client.get("/health")
                assert health.status_code == 200
    assert texts[2] == texts[1]
    assert all(texts[1])
    (whole,), ranks = held[1], held[2]
    assert [r["kv"] for r in ranks] == [whole["kv"] // 2] * 2
    assert all(0 < r["weights"] < whole["weights"] for r in ranks)
    # each executing process packs its projections before it reports ready
    assert whole["packed"] > 0 and all(0 < r["packed"] < whole["packed"] for r in ranks)


async def test_replicated_kv_head_greedy_seeded_and_copy_speculation(tiny_draft: Path) -> None:
    """One KV head on two ranks (replicated): greedy, seeded sampling and copy
    speculation on two ranks give one rank's tokens (the counter-based sampler draws
    the same ids on every rank)."""
    prompts = [prompt_of(9, 1), prompt_of(20, 2) * 2]
    with trio.fail_after(DEADLINE_S):
        out = {tp: await runs(tiny_draft, tp, prompts, 6, (GREEDY, SEEDED)) for tp in (1, 2)}
        (copy,) = await runs(tiny_draft, 2, prompts, 6, (GREEDY,), speculation="adaptive",
                             draft_source="copy", draft_depth=2)
    assert out[2] == out[1]
    assert out[2][0] == [hf_greedy(tiny_draft, p, 6) for p in prompts]  # transformers'
    assert out[1][1] != out[1][0]  # sampled, not greedy
    assert copy == out[1][0]


async def test_learned_draft_rounds_agree_across_ranks(tiny_llama: Path, tiny_draft: Path
                                                     ) -> None:
    """ACC-16: fixed-depth learned speculation with the draft sharded too: greedy and
    seeded sampled tokens on two ranks equal one rank's (the rounds' identities,
    consumption and emitted prefixes agree, or the validator would fail the frames and
    the requests would end in an error).

    Seeded speculative output is a function of the rounds run: which tokens a round
    emits depends on where it starts and how many rows it verifies. The test makes
    those decisions equal in both runtimes. Fixed depth: adaptive selection picks
    shapes by measured time. Unbounded requests, read for their first tokens only: a
    round's rows are capped by the output tokens left after the frames still in flight
    (QUEUE-48), and how many are in flight when the planner decides depends on timing,
    so requests that end within reach would run narrower last rounds in one runtime
    than in the other. Far from the end every round is ``D + 1`` rows wide."""
    prompts = [prompt_of(9, 3), prompt_of(5, 4) * 3]
    spec = {"speculation": "fixed", "draft_source": "draft", "draft_model_dir": tiny_draft,
            "draft_depth": 2}
    with trio.fail_after(DEADLINE_S):
        out = {tp: await runs(tiny_llama, tp, prompts, UNBOUNDED_TOKENS, (GREEDY, SEEDED),
                              read=8, **spec)
               for tp in (1, 2)}
    assert out[2] == out[1]
    assert out[1][0] != out[1][1]


def group_processes(before: set[int | None]) -> list[multiprocessing.process.BaseProcess]:
    """The device processes started since ``before``, in rank order (their stream
    names are numbered as the ranks are created)."""
    started = [p for p in device_processes() if p.pid not in before]
    return sorted(started, key=lambda p: int(p.name.rsplit("-", 1)[1]))


MAX_TOKENS = 240
"""Per request of a fault test: more than the test lets them produce."""


async def signal_rank_mid_load(rt: Runtime, ranks: list[multiprocessing.process.BaseProcess],
                               how: signal.Signals) -> list[tuple[int, Finished]]:
    """Start three requests, send ``how`` to rank 1 once tokens flow, and return each
    request's token count and outcome."""
    outcomes: list[tuple[int, Finished]] = []
    first_token = trio.Event()

    async def one(i: int) -> None:
        outcomes.append(await run_request(rt, prompt_of(8, i), MAX_TOKENS, first_token))

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
        await first_token.wait()  # mid-load: frames are in flight
        victim = ranks[1].pid
        assert victim is not None
        os.kill(victim, how)
    return outcomes


async def test_killed_rank_fails_requests_and_shuts_down_cleanly(tiny_llama: Path) -> None:
    """A rank killed mid-load: in-flight and later requests fail naming the lost rank,
    the runtime reports it, and no device process is left behind."""
    before = {p.pid for p in device_processes()}
    with trio.fail_after(DEADLINE_S):
        async with open_runtime(config_for(tiny_llama, capture_forward=False,
                                           tensor_parallel_size=2)) as rt:
            ranks = group_processes(before)
            assert len(ranks) == 2 and rt.device_fault is None
            outcomes = await signal_rank_mid_load(rt, ranks, signal.SIGKILL)
            fault = rt.device_fault
            assert fault is not None and "rank 1" in fault and "SIGKILL" in fault
            late_tokens, late = await run_request(rt, prompt_of(8, 9), 4)
    for produced, finished in outcomes:
        assert finished.reason == "error"
        assert "rank" in finished.message and "SIGKILL" in finished.message
        assert produced < MAX_TOKENS
    assert late.reason == "error" and "rank" in late.message
    assert late_tokens == 0
    assert [p for p in device_processes() if p.pid not in before] == []


async def test_hung_rank_fails_requests_within_the_collective_timeout(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stopped mid-load (SIGSTOP): its peer's collective times out after
    ``FLARE_TP_TIMEOUT_S``, the frames fail, the group stops and the runtime reports
    it; shutdown kills the stopped rank."""
    # Short enough to keep the test quick, long enough that a rank slowed by a loaded
    # machine (loading, warming up) is not taken for a hung one before the SIGSTOP.
    monkeypatch.setenv("FLARE_TP_TIMEOUT_S", "10")
    before = {p.pid for p in device_processes()}
    with trio.fail_after(DEADLINE_S):
        async with open_runtime(config_for(tiny_llama, capture_forward=False,
                                           tensor_parallel_size=2)) as rt:
            ranks = group_processes(before)
            outcomes = await signal_rank_mid_load(rt, ranks, signal.SIGSTOP)
            fault = rt.device_fault
            assert fault is not None and "tensor-parallel group stopped" in fault
            assert "Timed out" in fault
    for produced, finished in outcomes:
        assert finished.reason == "error" and produced < MAX_TOKENS
    assert [p for p in device_processes() if p.pid not in before] == []
