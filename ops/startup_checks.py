"""What ``flare run`` checks before it prepares anything, and how a start-up failure reads.

Preparing the programs takes seconds to minutes, so everything that can be known
without it is checked first: the model and draft directories (``config.json``
readable, a supported architecture, a tokenizer, weight files), the backend's device,
the chat-template override, and the listening socket, which is bound here and handed to
the HTTP server so that a port already in use fails before preparation, not after.

Every failure is ONE line naming the cause and the flag or file, with exit status 2:
``flare run: error: ...`` on the console, one JSON object (event ``server.start_failed``)
under ``--log-format json``. ``startup_cause`` finds such a failure inside the exception
groups trio's nurseries raise when it surfaces only during preparation.
"""

from __future__ import annotations

import pathlib
from typing import TextIO

from actors.config import ConfigError
from app.chat_template import ChatTemplateError
from gpu import BackendUnavailable, ModelConfig, ModelLoadError, load_served_config
from gpu.backends.cuda_probe import probe_cuda
from gpu.model.config import UnsupportedModelError
from ops.failure_line import found_in, write_failure

STARTUP_FAILURES: tuple[type[BaseException], ...] = (
    ConfigError, ChatTemplateError, ModelLoadError, UnsupportedModelError,
    BackendUnavailable, FileNotFoundError,
)
"""The failures that mean "this configuration cannot start", not a bug: reported as one
line wherever they surface during start-up."""


class StartupError(Exception):
    """Raised by the checks here; ``str()`` names the cause and the flag or file."""


def check_model_dir(path: pathlib.Path, *, flag: str,
                    needs_tokenizer: bool = True) -> ModelConfig:
    """The model configuration of ``path``, once its files are there and supported."""
    if not path.is_dir():
        raise StartupError(f"{flag}: no such directory: {path}")
    try:
        config = load_served_config(path)[0]
    except UnsupportedModelError as exc:
        raise StartupError(f"{flag} {path}: unsupported model: {exc} "
                           f"(in {path / 'config.json'})") from None
    except ModelLoadError as exc:
        raise StartupError(f"{flag} {path}: {exc}") from None
    if needs_tokenizer and not (path / "tokenizer.json").is_file():
        raise StartupError(f"{flag} {path}: tokenizer.json not found (flare reads the "
                           "tokenizer from the model directory)")
    index = path / "model.safetensors.index.json"
    if not index.is_file() and not any(path.glob("*.safetensors")):
        raise StartupError(f"{flag} {path}: no *.safetensors weight files")
    return config


def check_backend(name: str) -> None:
    """``--backend cuda`` needs a usable CUDA device (the probe opens nothing)."""
    if name != "cuda":
        return
    probe = probe_cuda()
    if not probe.available:
        raise StartupError(f"--backend cuda: {probe.describe()}")


def startup_cause(exc: BaseException) -> BaseException | None:
    """The start-up failure behind ``exc`` (also inside exception groups), if any."""
    return found_in(exc, (*STARTUP_FAILURES, StartupError))


def report_failure(message: str, *, log_format: str, stream: TextIO | None = None) -> int:
    """Write the one line of a start-up failure (event ``server.start_failed``);
    returns the exit status."""
    return write_failure(message, prog="flare run", json_format=log_format == "json",
                         event="server.start_failed", logger="flare.run", stream=stream)
