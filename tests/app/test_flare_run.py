"""``flare run``: flags are validated before anything loads (POL-19, POL-24, SPEC-11
reach the config), a missing runtime is reported rather than faked, and SIGTERM drains
in-flight streams before the runtime closes."""

from __future__ import annotations

import json
import math
import pathlib
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import structlog
import trio
import trio.testing
from http_fakes import FakeRuntime, TinyCodec
from http_harness import SseReader, client_for

from actors.config import DEFAULT_DRAFT_CATCH_UP, DEFAULT_MODEL_DIR, ConfigError, RuntimeConfig
from actors.system import open_runtime
from app import AppSettings, ServerHandle
from ops import cli
from ops.run_command import build_app_settings, build_runtime_config, serve_until_signalled


@pytest.fixture
def model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "model").mkdir()
    return tmp_path / "model"


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-batch", "0"], "--max-batch (--max-num-seqs) must be 1..64, got 0"),
    (["--max-batch", "128"], "--max-batch (--max-num-seqs) must be 1..64, got 128"),
    (["--prefill-capacity", "100"], "multiples of 64"),
    (["--speculative-token-capacity", "-1"], "--speculative-token-capacity"),
    (["--scheduler-terminal-value", "-1"], "--scheduler-terminal-value must be finite"),
    (["--scheduler-terminal-value", "nan"], "--scheduler-terminal-value must be finite"),
    (["--scheduler-terminal-age-price", "inf"], "--scheduler-terminal-age-price must be finite"),
    (["--mtp-adaptive-verification-alpha", "0"], "--mtp-adaptive-verification-alpha"),
    (["--max-queue", "0"], "max_queue"),
    (["--max-request-bytes", "10"], "--max-request-bytes"),
    (["--shutdown-grace", "-1"], "--shutdown-grace"),
    (["--max-context", "0"], "--max-context"),
    (["--api-key", " "], "--api-key"),
    (["--draft-model", "/definitely/not/here"], "--draft-model: no such directory"),
    (["--kv-pages", "0"], "--kv-pages must be positive"),
    # A learned-draft speculative mode needs its draft model.
    (["--speculation", "fixed"], "--speculation fixed with --draft-source draft needs --draft-model"),
    (["--speculation", "adaptive"], "--speculation adaptive with --draft-source draft needs"),
    (["--speculation", "fixed", "--draft-source", "copy", "--draft-depth", "0"],
     "--draft-depth must be 1..7"),
    (["--speculation", "fixed", "--draft-source", "copy", "--scheduler-policy", "fcfs"],
     "runs with the seed's scheduler only"),
])
def test_pol_19_invalid_values_stop_before_loading(
        flags: list[str], message: str, model_dir: pathlib.Path,
        runtime_opened: list[RuntimeConfig], capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run", "--model", str(model_dir), *flags])
    assert code == 2
    assert message in capsys.readouterr().err
    assert runtime_opened == []


def test_missing_model_directory_is_named(runtime_opened: list[RuntimeConfig],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--model", "/no/such/model"]) == 2
    assert "--model: no such directory: /no/such/model" in capsys.readouterr().err
    assert runtime_opened == []


@pytest.mark.parametrize("flags", [["--log-format", "xml"], ["--port", "70000"],
                                   ["--backend", "tpu"], ["--prefill-capacity", "a,b"],
                                   ["--scheduler-policy", "lottery"], ["--max-batch", "two"]])
def test_unparseable_flags_exit_with_usage_error(
        flags: list[str], model_dir: pathlib.Path, runtime_opened: list[RuntimeConfig],
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--model", str(model_dir), *flags])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert runtime_opened == []


def test_run_configures_logging_then_serves_the_runtime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    formats: list[str] = []
    served: list[object] = []
    monkeypatch.setattr("ops.run_command.configure_logging",
                        lambda fmt, level: formats.append(fmt))

    async def serve(open_runtime: object, *args: object, **kwargs: object) -> None:
        served.append(open_runtime)

    monkeypatch.setattr("ops.run_command.serve_until_signalled", serve)
    assert cli.main(["run", "--model", str(DEFAULT_MODEL_DIR), "--port", "0",
                     "--log-format", "json"]) == 0
    assert formats == ["json"]
    assert served == [open_runtime]


def test_spec_11_flags_reach_the_runtime_config(model_dir: pathlib.Path) -> None:
    argv = [
        "run", "--model", str(model_dir), "--draft-model", str(model_dir), "--max-batch", "4",
        "--prefill-capacity", "64,4096", "--mixed-prefill", "--speculative-token-capacity", "6",
        "--scheduler-policy", "throughput", "--scheduler-terminal-value", "0.5",
        "--scheduler-terminal-age-price", "0", "--mtp-adaptive-verification-alpha", "1.5",
        "--backend", "cuda", "--max-queue", "9", "--api-key", "k", "--served-model-name", "m",
        "--eager-forward"]
    args = cli.build_parser(argv).parse_args(argv)
    config = build_runtime_config(args)
    assert config == RuntimeConfig(
        model_dir=model_dir, draft_model_dir=model_dir, backend="cuda", max_batch=4,
        prefill_capacities=(64, 4096), mixed_prefill=True, speculation="adaptive",
        speculative_token_capacity=6, max_queue=9, scheduler_policy="throughput",
        scheduler_terminal_value=0.5, scheduler_terminal_age_price=0.0,
        adaptive_verification_alpha=1.5, capture_forward=False)
    settings = build_app_settings(args)
    assert (settings.api_key, settings.served_model_name) == ("k", "m")


@pytest.mark.parametrize("preset", ["first-token", "client-fair", "smooth", "stream-start",
                                    "steady"])
def test_the_extension_presets_are_scheduler_policies(model_dir: pathlib.Path,
                                                       preset: str) -> None:
    argv = ["run", "--model", str(model_dir), "--scheduler-policy", preset]
    config = build_runtime_config(cli.build_parser(argv).parse_args(argv))
    assert config.scheduler_policy == preset
    config.validate()


@pytest.mark.parametrize(("flags", "mixed"), [
    ([], True),
    (["--no-mixed-prefill"], False),
    (["--draft-source", "copy"], False),
    (["--draft-source", "copy", "--mixed-prefill"], True),
    (["--speculation", "off", "--draft-model", "{model}"], True),
])
def test_mixed_programs_by_default_without_speculation(
        model_dir: pathlib.Path, flags: list[str], mixed: bool) -> None:
    """CAT-12 as ``flare run`` ships it: mixed programs are prepared unless the flag turns
    them off, except for speculative loads, where ``--mixed-prefill`` adds them."""
    argv = ["run", "--model", str(model_dir),
            *(flag.format(model=model_dir) for flag in flags)]
    assert build_runtime_config(cli.build_parser(argv).parse_args(argv)).mixed_prefill is mixed


@pytest.mark.parametrize(("flags", "mode", "source", "depth", "counterfactuals", "catch_up"), [
    ([], "off", "draft", 4, True, DEFAULT_DRAFT_CATCH_UP),
    (["--draft-source", "copy"], "adaptive", "copy", 4, True, DEFAULT_DRAFT_CATCH_UP),
    (["--draft-source", "copy", "--no-copy-counterfactuals"], "adaptive", "copy", 4, False,
     DEFAULT_DRAFT_CATCH_UP),
    (["--speculation", "fixed", "--draft-source", "copy", "--draft-depth", "2"], "fixed", "copy",
     2, True, DEFAULT_DRAFT_CATCH_UP),
    (["--draft-model", "{model}", "--draft-catch-up", "0"], "adaptive", "draft", 4, True, 0),
    (["--draft-model", "{model}", "--draft-catch-up", "8"], "adaptive", "draft", 4, True, 8),
])
def test_speculation_flags_reach_the_runtime_config(
        model_dir: pathlib.Path, flags: list[str], mode: str, source: str, depth: int,
        counterfactuals: bool, catch_up: int) -> None:
    """Speculation modes, the draft source, counterfactual copy rounds and the lagging
    draft context's catch-up bound are selectable at ``flare run``."""
    argv = ["run", "--model", str(model_dir),
            *(flag.format(model=model_dir) for flag in flags)]
    config = build_runtime_config(cli.build_parser(argv).parse_args(argv))
    assert (config.speculation, config.draft_source, config.draft_depth,
            config.copy_counterfactuals, config.draft_catch_up) == (
        mode, source, depth, counterfactuals, catch_up)
    config.validate()


@pytest.mark.parametrize(("flags", "mode"), [
    ([], "raw_logprobs"),
    (["--logprobs-mode", "raw_logprobs"], "raw_logprobs"),
    (["--logprobs-mode", "processed_logprobs"], "processed_logprobs"),
])
def test_logprobs_mode_reaches_the_runtime_config(
        model_dir: pathlib.Path, flags: list[str], mode: str) -> None:
    """vLLM's ``--logprobs-mode``: raw logprobs by default, processed on request."""
    argv = ["run", "--model", str(model_dir), *flags]
    config = build_runtime_config(cli.build_parser(argv).parse_args(argv))
    assert config.logprobs_mode == mode
    config.validate()


def test_an_unknown_logprobs_mode_is_refused(model_dir: pathlib.Path) -> None:
    argv = ["run", "--model", str(model_dir), "--logprobs-mode", "raw_logits"]
    with pytest.raises(SystemExit):
        cli.build_parser(argv).parse_args(argv)
    with pytest.raises(ConfigError, match="--logprobs-mode must be one of"):
        RuntimeConfig(model_dir=model_dir, logprobs_mode="raw_logits").validate()  # type: ignore[arg-type]


def test_an_out_of_range_draft_catch_up_is_a_config_error(model_dir: pathlib.Path) -> None:
    argv = ["run", "--model", str(model_dir), "--draft-model", str(model_dir),
            "--draft-catch-up", "-1"]
    config = build_runtime_config(cli.build_parser(argv).parse_args(argv))
    with pytest.raises(ConfigError, match=r"--draft-catch-up must be 0\.\.256"):
        config.validate()


@pytest.mark.parametrize(("flags", "valid"), [
    (["--draft-source", "copy", "--mixed-prefill", "--no-speculative-mixed"], True),
    (["--draft-source", "copy", "--no-speculative-mixed"], False),
    (["--draft-source", "copy", "--speculation", "fixed", "--mixed-prefill",
      "--no-speculative-mixed"], False),
    (["--no-speculative-mixed"], False),
])
def test_no_speculative_mixed_needs_an_adaptive_load_with_mixed_programs(
        model_dir: pathlib.Path, flags: list[str], valid: bool) -> None:
    """``--no-speculative-mixed`` (flare's departure from MIX-41/MIX-43) reaches the
    runtime config, and is refused where it would change nothing or leave fixed-width
    mode no mixed program."""
    argv = ["run", "--model", str(model_dir), *flags]
    config = build_runtime_config(cli.build_parser(argv).parse_args(argv))
    assert config.speculative_mixed is False
    if valid:
        config.validate()
    else:
        with pytest.raises(ConfigError, match="--no-speculative-mixed needs"):
            config.validate()


def test_pol_24_help_states_the_alpha_effect(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exponent on prefix-survival estimates" in text
    assert "above 1 discounts" in text


async def test_sigterm_drains_streams_then_closes_runtime(codec: TinyCodec,
                                                          model_dir: pathlib.Path) -> None:
    rt = FakeRuntime(codec, gated=True, reply="one two")
    closed = trio.Event()

    @asynccontextmanager
    async def open_fake(config: RuntimeConfig) -> AsyncIterator[FakeRuntime]:
        assert config.max_batch == 4
        try:
            yield rt
        finally:
            closed.set()

    config = RuntimeConfig(model_dir=model_dir, max_batch=4)
    with trio.fail_after(20), structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            server: ServerHandle = await nursery.start(partial(
                serve_until_signalled, open_fake, config, AppSettings(), host="127.0.0.1",
                port=0, grace_s=15))
            async with (client_for(server) as client,
                        client.stream("POST", "/v1/completions", json={
                            "prompt": "Hi", "max_tokens": 10, "stream": True}) as response):
                reader = SseReader(response)
                rt.release(1)
                await reader.next_data()
                signal.raise_signal(signal.SIGTERM)
                await trio.testing.wait_all_tasks_blocked()
                assert server.service.draining and not closed.is_set()
                rt.release(100)
                rest = await reader.rest()
        assert closed.is_set()
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "stop"
    events = [e["event"] for e in logs]
    assert events.index("server.ready") < events.index("server.signal")
    assert events[-1] == "server.stopped"
    ready = next(e for e in logs if e["event"] == "server.ready")
    assert ready["address"] == server.url and ready["address"].startswith("http://127.0.0.1:")
    assert math.isfinite(next(e for e in logs if e["event"] == "runtime.prepared")["seconds"])


def test_cli_imports_only_the_selected_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command whose module is broken cannot break the others (ops/cli.py)."""
    monkeypatch.setattr(cli, "COMMANDS", (
        *cli.COMMANDS, (("broken",), "ops.no_such_module_for_this_test", "broken on purpose")))
    argv = ["bench", "plan", "--help"]
    parser = cli.build_parser(argv)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 0
    missing = cli.build_parser(["broken"]).parse_args(["broken"])
    assert missing._missing is True


@pytest.mark.parametrize("nested", [False, True])
def test_an_unavailable_backend_is_a_message_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        nested: bool) -> None:
    """``--backend cuda`` on a machine without a GPU: every command says why and exits 2,
    also when the error surfaces from inside a trio nursery (an exception group)."""
    from gpu.backends.protocol import BackendUnavailable
    from ops import bench_speculation

    def fail(args: object) -> int:
        error = BackendUnavailable("cuda: no CUDA device (for this test)")
        raise ExceptionGroup("nursery", [ValueError("other"), error]) if nested else error

    monkeypatch.setattr(bench_speculation, "main", fail)
    assert cli.main(["bench", "speculation", "--backend", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == "flare: cuda: no CUDA device (for this test)"


def test_other_errors_still_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    from ops import bench_speculation

    def fail(args: object) -> int:
        raise ExceptionGroup("nursery", [ValueError("a bug")])

    monkeypatch.setattr(bench_speculation, "main", fail)
    with pytest.raises(ExceptionGroup):
        cli.main(["bench", "speculation"])
