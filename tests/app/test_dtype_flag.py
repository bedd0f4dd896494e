"""``flare run --dtype``: the choice reaches the runtime configuration, ``auto`` is the
default, and a value outside auto/float32/bfloat16/float16 is a usage error."""

from __future__ import annotations

import pathlib

import pytest

from actors.config import ConfigError, RuntimeConfig
from ops import cli
from ops.run_command import build_runtime_config


@pytest.mark.parametrize(("flags", "dtype"), [([], "auto"), (["--dtype", "bfloat16"], "bfloat16"),
                                              (["--dtype", "float32"], "float32"),
                                              (["--dtype", "float16"], "float16")])
def test_the_dtype_flag_reaches_the_runtime_config(tmp_path: pathlib.Path, flags: list[str],
                                                   dtype: str) -> None:
    argv = ["run", "--model", str(tmp_path), *flags]
    config = build_runtime_config(cli.build_parser(argv).parse_args(argv))
    assert config.dtype == dtype
    config.validate()


def test_an_unknown_dtype_is_refused(tmp_path: pathlib.Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--model", str(tmp_path), "--dtype", "int8"])
    assert exit_info.value.code == 2
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--dtype must be one of auto, float32"):
        RuntimeConfig(model_dir=tmp_path, dtype="int8").validate()  # type: ignore[arg-type]


def test_a_dtype_the_backend_does_not_run_stops_before_loading(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--model", str(tmp_path), "--backend", "cuda",
                     "--dtype", "float32"]) == 2
    assert "--dtype float32 is not supported on the cuda backend" in capsys.readouterr().err
