"""``flare run`` start-up failures: each is ONE line naming the cause and the flag or
file, exit status 2, a JSON object under ``--log-format json``, and nothing is prepared
(the checks run before ``runtime.preparing``; a port in use is found by binding it
first)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from actors.config import DEFAULT_MODEL_DIR, RuntimeConfig
from ops import cli
from ops.startup_checks import startup_cause

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def models(tmp_path: pathlib.Path) -> pathlib.Path:
    """Broken copies of the embedded model: one per start-up failure."""
    unsupported = tmp_path / "unsupported"
    shutil.copytree(DEFAULT_MODEL_DIR, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (unsupported / "config.json").write_text(json.dumps(config))
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(DEFAULT_MODEL_DIR, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    no_weights = tmp_path / "no-weights"
    shutil.copytree(DEFAULT_MODEL_DIR, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "template.jinja").write_text("{% for m in messages %}{{ m.content }")
    return tmp_path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another server is listening on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


BATTERY = [
    (["--model", "{tmp}/nowhere"], "--model: no such directory: {tmp}/nowhere"),
    (["{tmp}/empty"], "--model {tmp}/empty: config.json not found in {tmp}/empty"),
    (["{tmp}/unsupported"], "--model {tmp}/unsupported: unsupported model: architecture "
                            "['FancyNewForCausalLM'] is not supported"),
    (["{tmp}/no-tokenizer"], "--model {tmp}/no-tokenizer: tokenizer.json not found"),
    (["{tmp}/no-weights"], "--model {tmp}/no-weights: no *.safetensors weight files"),
    (["--draft-model", "{tmp}/unsupported"], "--draft-model {tmp}/unsupported: unsupported"),
    (["--chat-template", "{tmp}/template.jinja"], "--chat-template does not compile"),
    (["--chat-template", "{tmp}/no-such-template"], "--chat-template {tmp}/no-such-template: "
                                                    "not a readable file"),
    (["--max-num-seqs", "0"], "--max-batch (--max-num-seqs) must be 1..64, got 0"),
    (["--max-num-batched-tokens", "100"], "--max-num-batched-tokens must be a positive "
                                          "multiple of 64, got 100"),
    (["{tmp}/empty", "--model", "{tmp}/unsupported"], "the model is given twice"),
    (["--max-num-batched-tokens", "128", "--prefill-capacity", "64"], "give one"),
]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    try:
        status = cli.main(["run", "--port", "0", *argv])
    except SystemExit as exit_info:  # argparse's usage errors
        status = int(exit_info.code or 0)
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).splitlines()


@pytest.mark.parametrize("log_format", ["console", "json"])
@pytest.mark.parametrize(("flags", "message"), BATTERY)
def test_each_start_up_failure_is_one_line_and_status_2(
        flags: list[str], message: str, log_format: str, models: pathlib.Path,
        runtime_opened: list[RuntimeConfig], capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f.format(tmp=models) for f in flags] + ["--log-format", log_format]
    status, lines = _run(argv, capsys)
    assert status == 2
    assert len(lines) == 1, lines
    expected = message.format(tmp=models)
    if log_format == "json":
        record = json.loads(lines[0])
        assert (record["event"], record["level"], record["exit_status"]) == (
            "server.start_failed", "error", 2)
        assert expected in record["error"]
    else:
        assert lines[0].startswith("flare run: error: ")
        assert expected in lines[0]
    assert runtime_opened == []


@pytest.mark.parametrize("log_format", ["console", "json"])
@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "70000"], "argument --port: port must be 0..65535, got 70000"),
    (["--max-num-seqs", "many"], "invalid int value: 'many'"),
    (["--gpu-memory-utilization", "1.5"], "must be in (0, 1], got 1.5"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_flag_value_is_one_line_and_status_2(
        flags: list[str], message: str, log_format: str, runtime_opened: list[RuntimeConfig],
        capsys: pytest.CaptureFixture[str]) -> None:
    status, lines = _run([*flags, "--log-format", log_format], capsys)
    assert status == 2
    assert len(lines) == 1, lines
    text = json.loads(lines[0])["error"] if log_format == "json" else lines[0]
    assert message in text
    assert "--help lists the flags" in text
    assert runtime_opened == []


def test_a_port_in_use_is_found_before_preparation(
        busy_port: int, runtime_opened: list[RuntimeConfig],
        capsys: pytest.CaptureFixture[str]) -> None:
    status, lines = _run(["--port", str(busy_port)], capsys)
    assert status == 2
    assert lines == [f"flare run: error: --port {busy_port}: cannot listen on "
                     f"127.0.0.1:{busy_port}: Address already in use"]
    assert runtime_opened == []


def test_a_failure_inside_preparation_is_one_line_too(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What only preparation finds (here: a checkpoint tensor of the wrong shape) comes
    out of trio's nurseries as an exception group; it is still one line and status 2."""
    from gpu import ModelLoadError

    def fail(config: RuntimeConfig) -> object:
        raise ExceptionGroup("nursery", [ModelLoadError("model.norm.weight has shape (3,), "
                                                        "expected (64,)")])

    monkeypatch.setattr("ops.run_command.open_runtime", fail)
    monkeypatch.setattr("ops.run_command.configure_logging", lambda fmt, level: None)
    status, lines = _run(["--log-format", "json"], capsys)
    assert status == 2
    failure = [json.loads(line) for line in lines if '"server.start_failed"' in line]
    assert [f["error"] for f in failure] == ["model.norm.weight has shape (3,), expected (64,)"]


def test_bugs_are_not_mistaken_for_start_up_failures() -> None:
    assert startup_cause(ExceptionGroup("nursery", [KeyError("bug")])) is None


def test_a_failure_after_the_server_started_keeps_its_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the server holds the socket, a ``FileNotFoundError`` is no start-up failure."""

    async def serve(*args: object, listener: socket.socket, **kwargs: object) -> int:
        os.close(listener.detach())  # serve_http hands it to the server
        raise FileNotFoundError("a file the running server needed")

    monkeypatch.setattr("ops.run_command.serve_until_signalled", serve)
    monkeypatch.setattr("ops.run_command.configure_logging", lambda fmt, level: None)
    with pytest.raises(FileNotFoundError):
        cli.main(["run", "--port", "0"])


def test_the_flare_command_writes_one_json_line_for_a_port_in_use(busy_port: int) -> None:
    """The real entry point, in its own process: nothing else reaches stdout or stderr
    (no traceback, no ``runtime.preparing``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "ops.cli", "run", "--port", str(busy_port),
         "--log-format", "json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2, lines
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["event"] == "server.start_failed"
    assert f"--port {busy_port}: cannot listen" in record["error"]
