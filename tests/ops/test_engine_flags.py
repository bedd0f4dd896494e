"""The engine flags are declared once (``ops.engine_flags``): ``flare run`` and every bench
command that builds a runtime accept the same spellings with the same defaults and help,
and turn them into the same ``RuntimeConfig`` fields."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from ops import bench_programs, bench_runtime, bench_speculation, bench_structured
from ops.engine_flags import ENGINE_FLAGS, add_engine_flags, engine_config
from ops.run_command import add_arguments as run_arguments
from ops.run_command import build_runtime_config

ALL_FLAGS = ["--backend", "cpu", "--eager-forward", "--no-device-process", "-tp", "2",
             "--host-grammars"]
COMMANDS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "run": run_arguments, "bench runtime": bench_runtime.add_arguments,
    "bench speculation": bench_speculation.add_arguments,
    "bench structured": bench_structured.add_arguments}


def parser_of(add: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser


def engine_actions(parser: argparse.ArgumentParser) -> dict[str, tuple[object, ...]]:
    return {a.dest: (tuple(a.option_strings), a.default, a.help, a.choices)
            for a in parser._actions if a.dest in ENGINE_FLAGS}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_declares_the_same_engine_flags(command: str) -> None:
    reference = argparse.ArgumentParser()
    add_engine_flags(reference)
    assert engine_actions(parser_of(COMMANDS[command])) == engine_actions(reference)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reads_the_flags_into_the_same_config(command: str) -> None:
    args = parser_of(COMMANDS[command]).parse_args(ALL_FLAGS)
    assert engine_config(args) == {"backend": "cpu", "capture_forward": False,
                                   "device_process": False, "tensor_parallel_size": 2,
                                   "resident_grammars": False}


def test_flare_run_builds_its_runtime_config_from_the_engine_flags() -> None:
    config = build_runtime_config(parser_of(run_arguments).parse_args(ALL_FLAGS))
    assert (config.capture_forward, config.device_process, config.tensor_parallel_size,
            config.resident_grammars) == (False, False, 2, False)
    default = build_runtime_config(parser_of(run_arguments).parse_args([]))
    assert (default.backend, default.capture_forward, default.device_process,
            default.tensor_parallel_size, default.resident_grammars) == ("cpu", True, True, 1,
                                                                         True)


def test_a_command_declaring_some_flags_gets_the_defaults_of_the_rest() -> None:
    parser = parser_of(bench_programs.add_arguments)
    assert set(engine_actions(parser)) == {"backend", "tensor_parallel_size"}
    assert engine_config(parser.parse_args(["-tp", "2"])) == {
        "backend": "cpu", "capture_forward": True, "device_process": True,
        "tensor_parallel_size": 2, "resident_grammars": True}
    with pytest.raises(ValueError, match="not engine flags"):
        add_engine_flags(argparse.ArgumentParser(), only=("max_batch",))
