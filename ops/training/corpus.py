"""The training text for the embedded default model: the Python standard library's own source.

Every machine that runs flare has these files, so the recipe needs no download. This module owns
choosing the files (a deterministic, sorted list with test suites left out), splitting them into
training and held-out sets by file, and turning them into documents: each file as it is, plus
chat-formatted documents built from documented functions (a user asks for a function by its name
and docstring summary, the assistant answers with the function's source) so the model learns the
chat template and to end its turn with ``<|end|>``. It reads files; it never writes any.
"""

from __future__ import annotations

import ast
import os
import random
import sysconfig
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ops.training.special_tokens import END_OF_TEXT, render_chat

# Directories whose files are mostly test data or generated tables: they teach little Python.
EXCLUDED_DIRECTORIES = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
)
# One file in this many goes to the held-out set (chosen by position in the sorted list).
HELD_OUT_EVERY = 40
# Function sources longer than this are not turned into chat examples (they would dominate).
MAX_CHAT_ANSWER_CHARS = 1600
SYSTEM_PROMPTS = (
    "You are a helpful Python programming assistant.",
    "You write clear, idiomatic Python.",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CorpusSplit:
    """The chosen source files, split by file into training and held-out sets."""

    train_files: tuple[Path, ...]
    held_out_files: tuple[Path, ...]


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path, max_files: int | None = None) -> tuple[Path, ...]:
    """All ``.py`` files under ``root`` outside excluded directories, in sorted order."""
    found: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        # Pruning in place keeps the walk out of site-packages and the test suites entirely.
        subdirectories[:] = [d for d in subdirectories if d not in EXCLUDED_DIRECTORIES]
        found.extend(Path(directory) / name for name in names if name.endswith(".py"))
    files = sorted(found)
    return tuple(files[:max_files]) if max_files is not None else tuple(files)


def split_files(files: Sequence[Path]) -> CorpusSplit:
    """Every ``HELD_OUT_EVERY``-th file (offset so small lists still train) is held out."""
    held_out = tuple(f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)
    if not held_out and len(files) > 1:
        held_out = (files[-1],)
    train = tuple(f for f in files if f not in held_out)
    return CorpusSplit(train_files=train, held_out_files=held_out)


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 (a few stdlib files are latin-1)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def chat_examples(source: str, rng: random.Random) -> list[str]:
    """Chat documents built from the top-level documented functions and methods in ``source``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    examples: list[str] = []
    for node in _documented_functions(tree):
        docstring = ast.get_docstring(node)
        # Whole lines, dedented: ast.get_source_segment re-splits the file on every call.
        answer = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno or 0]))
        if not docstring or not answer or len(answer) > MAX_CHAT_ANSWER_CHARS:
            continue
        summary = docstring.strip().splitlines()[0].strip()
        if not summary:
            continue
        question = _question(node.name, summary, rng)
        messages = []
        if rng.random() < 0.5:
            messages.append(("system", rng.choice(SYSTEM_PROMPTS)))
        messages.append(("user", question))
        messages.append(("assistant", answer))
        examples.append(render_chat(messages, add_generation_prompt=False) + END_OF_TEXT)
    return examples


def build_documents(files: Iterable[Path], seed: int, with_chat: bool = True) -> list[str]:
    """Each readable file followed by ``<|endoftext|>``, plus its chat examples, in a seeded order."""
    rng = random.Random(seed)
    documents: list[str] = []
    for path in files:
        text = read_text(path)
        if text is None or not text.strip():
            continue
        documents.append(text + END_OF_TEXT)
        if with_chat:
            documents.extend(chat_examples(text, rng))
    rng.shuffle(documents)
    return documents


def _documented_functions(tree: ast.Module) -> Iterable[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
        elif isinstance(node, ast.ClassDef):
            for inner in node.body:
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield inner


def _question(name: str, summary: str, rng: random.Random) -> str:
    templates = (
        "Write a Python function `{name}`: {summary}",
        "Implement `{name}` in Python. {summary}",
        "{summary} Write it as a function named `{name}`.",
    )
    return rng.choice(templates).format(name=name, summary=summary)


__all__ = [
    "CorpusSplit",
    "build_documents",
    "chat_examples",
    "list_source_files",
    "split_files",
    "stdlib_root",
]
