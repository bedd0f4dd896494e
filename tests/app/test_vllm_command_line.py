"""A command line from vLLM's documentation starts ``flare run`` and serves: the real
entry point in its own process, one request under the served name, then SIGTERM."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from actors.config import DEFAULT_MODEL_DIR
from ops import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_LINE = [str(DEFAULT_MODEL_DIR), "--max-model-len", "2048", "--max-num-seqs", "16",
             "--served-model-name", "m", "--disable-log-requests"]
# Forward capture is orthogonal to the flags under test; eager start-up is seconds faster.
QUICK = ["--port", "0", "--log-format", "json", "--eager-forward"]


def _knows(flag: str) -> bool:
    argv = ["run", *VLLM_LINE, flag, "float32"]
    _, unknown = cli.build_parser(argv).parse_known_args(argv)
    return flag not in unknown


def _read(stream: object, lines: list[str], ready: threading.Event) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line)
        if '"server.ready"' in line:
            ready.set()


@pytest.mark.parametrize("extra", [
    pytest.param([], id="vllm-line"),
    pytest.param(["--dtype", "float32"], id="vllm-line-with-dtype", marks=pytest.mark.skipif(
        not _knows("--dtype"), reason="flare run has no --dtype flag in this build yet")),
])
def test_a_vllm_command_line_starts_and_serves(extra: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "run", *VLLM_LINE, *extra, *QUICK],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()
    reader = threading.Thread(target=_read, args=(proc.stderr, lines, ready), daemon=True)
    reader.start()
    try:
        assert ready.wait(120), "".join(lines)
        url = json.loads(next(line for line in lines if '"server.ready"' in line))["address"]
        with httpx.Client(base_url=url, timeout=30) as client:
            models = client.get("/v1/models").json()["data"]
            completion = client.post("/v1/completions", json={
                "model": "m", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert proc.stderr is not None
    proc.stderr.close()
    log = [json.loads(line) for line in lines]
    assert status == 0, lines
    assert [(m["id"], m["max_model_len"]) for m in models] == [("m", 2048)]
    assert completion.status_code == 200
    assert completion.json()["usage"]["completion_tokens"] == 4
    preparing = next(e for e in log if e["event"] == "runtime.preparing")
    assert preparing["max_batch"] == 16 and preparing["admission_order"] == "fifo"
    assert not [e for e in log if e["event"].startswith("request.")]  # --disable-log-requests
    assert not [e for e in log if e["level"] in ("warning", "error")]
