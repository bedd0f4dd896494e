"""A tensor-parallel group across machines, on loopback: the serving process runs rank
0 (``flare run -tp 2 --nnodes 2`` as a runtime here) and a separately started ``flare
rank -tp 2 --nnodes 2 --node-rank 1`` process, with its own environment, runs rank 1.
They meet at ``MASTER_ADDR``/``MASTER_PORT``; the rank receives its programs and
every launch from rank 0 over torch.distributed (``gpu.backends.rank_worker``).

Greedy completions over HTTP equal one rank's, and when the runtime closes, the rank
process exits with 0 (OPEN-37, ACC-16).
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys

import httpx
import pytest
import trio

from actors.config import DEFAULT_MODEL_DIR
from actors.system import open_runtime
from ops.testing import serve_app
from tests.actors.test_runtime_cpu import config_for

DEADLINE_S = 120.0
PROMPTS = ["def add(a, b):", "import os\n"]


async def completions(tp: int, nnodes: int = 1) -> list[str]:
    config = config_for(DEFAULT_MODEL_DIR, capture_forward=False, max_context=128,
                        tensor_parallel_size=tp, nnodes=nnodes)
    texts = []
    async with open_runtime(config) as rt, serve_app(rt) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
        for prompt in PROMPTS:
            reply = await client.post("/v1/completions", json={
                "model": rt.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
    return texts


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def output_of(process: trio.Process) -> str:
    """Everything ``process`` writes to its stdout, once it closes it."""
    assert process.stdout is not None
    chunks = []
    while chunk := await process.stdout.receive_some():
        chunks.append(chunk)
    return b"".join(chunks).decode()


async def test_a_rank_started_apart_serves_with_the_runtime_and_stops_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    port = str(free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "ops.cli", "rank", "-tp", "2", "--nnodes", "2",
               "--node-rank", "1"]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            rank: trio.Process = await nursery.start(functools.partial(
                trio.run_process, command, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, check=False))
            across = await completions(2, nnodes=2)
            output = await output_of(rank)  # the rank stops with the runtime
            assert await rank.wait() == 0, output
    assert "rank 1 of 2: joined" in output and "stopped the group" in output
    monkeypatch.delenv("MASTER_PORT")
    with trio.fail_after(DEADLINE_S):
        assert across == await completions(1)
    assert all(across)


def test_a_group_across_machines_needs_the_rendezvous_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu.backends.tensor_parallel import TensorParallelBackend

    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR:MASTER_PORT"):
        TensorParallelBackend(size=2, nnodes=2)
