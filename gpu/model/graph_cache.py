"""Traced forward graphs kept on disk, so a new process of the same model does not
trace them again.

Graphs are per process (``gpu.model.capture``), and every runtime on the CPU backend
starts a fresh device process, which would otherwise trace each of its programs'
graphs anew. ``GraphCache`` saves each traced graph (``torch.jit.save``) under a name
derived from everything the graph depends on:

- the graph's key (the forward's flags, the cache geometry, every input shape but the
  block tables' width) and the model's key (configuration, dtype, weight shapes);
- the torch and Python versions;
- the source of the forward: a digest of every module of ``gpu.model``, so any change
  to the model code names different files and old entries are never read; a traced
  program step (``ForwardCapture.replay``) also names the digest of the modules it
  runs beyond the model (``source_digest``).

The full key text is stored inside the file as well and compared on load; a file that
does not load, or holds another key, is ignored and replaced by a fresh trace. Writes
go to a temporary file renamed into place, so concurrent processes never read half a
file. The capture also replays a loaded graph beside the op-by-op forward once and
keeps it only when the two agree bit for bit.

Where: ``$FLARE_GRAPH_CACHE`` (``off`` or empty: no disk cache), else
``$XDG_CACHE_HOME/flare/graphs``, else ``~/.cache/flare/graphs``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import pathlib
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["GraphCache", "graph_cache_dir"]

ENV = "FLARE_GRAPH_CACHE"
_KEY_FILE = "flare-graph-key"


def graph_cache_dir() -> pathlib.Path | None:
    """The cache directory this process uses (module docstring), None when off."""
    setting = os.environ.get(ENV)
    if setting is not None:
        return None if setting.strip() in ("", "off") else pathlib.Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "flare" / "graphs"


@functools.cache
def code_digest() -> str:
    """A digest of the source of every ``gpu.model`` module (what a traced forward
    runs), with the torch and Python versions."""
    digest = hashlib.sha256(f"{torch.__version__} {sys.version}".encode())
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def source_digest(modules: tuple[str, ...]) -> str:
    """A digest of the source files of ``modules`` (dotted names): what a traced body
    graph runs beyond ``gpu.model`` (``ForwardCapture.replay``), for its key."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = None if spec is None else spec.origin
        if origin is None:
            raise ValueError(f"no source for module {name}")
        digest.update(name.encode())
        digest.update(pathlib.Path(origin).read_bytes())
    return digest.hexdigest()


class GraphCache:
    """Saved graphs in one directory."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory

    @classmethod
    def from_environment(cls) -> GraphCache | None:
        directory = graph_cache_dir()
        return None if directory is None else cls(directory)

    @staticmethod
    def key_text(key: tuple[object, ...]) -> str:
        return repr((code_digest(), key))

    def path_of(self, text: str) -> pathlib.Path:
        return self.directory / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}.pt"

    def load(self, key: tuple[object, ...]) -> Callable[..., torch.Tensor] | None:
        """The graph saved for ``key``; None when there is none, it does not load or it
        was saved for another key."""
        text = self.key_text(key)
        path = self.path_of(text)
        if not path.is_file():
            return None
        stored = {_KEY_FILE: ""}
        try:
            with _quiet():
                graph = torch.jit.load(str(path), _extra_files=stored)  # type: ignore[no-untyped-call]
        except Exception:  # a corrupt or foreign file: trace instead
            return None
        saved = stored[_KEY_FILE]
        if (saved.decode() if isinstance(saved, bytes) else saved) != text:
            return None
        return graph  # type: ignore[no-any-return]

    def save(self, key: tuple[object, ...], graph: Callable[..., torch.Tensor]) -> bool:
        """Store ``graph`` for ``key`` (atomically); False when the directory cannot be
        written (the cache is then only skipped)."""
        text = self.key_text(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            os.close(fd)
            try:
                with _quiet():
                    graph.save(tmp, _extra_files={_KEY_FILE: text})  # type: ignore[attr-defined]
                os.replace(tmp, self.path_of(text))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, RuntimeError):  # unwritable or full (torch's writer raises
            return False                 # RuntimeError): the cache is only skipped
        return True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """TorchScript's save and load are deprecated in favour of ``torch.export``, whose
    programs do not run without the interpreter lock (as ``gpu.model.capture``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield
