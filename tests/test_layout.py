"""Import-graph rules from docs/architecture.md: arrows point one way."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "policy": {"trio", "torch", "time", "datetime", "asyncio", "gpu", "actors", "app", "ops",
               "cuda", "structlog", "random"},
    "gpu": {"trio", "actors", "app", "ops"},
    "actors": {"app", "ops"},
    "app": {"ops"},
}


def imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_cat_5_cat_7_import_arrows(package: str) -> None:
    """Covers CAT-5 (policy imports no trio/torch/clock), CAT-7 (nothing imports ops)."""
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_roots(path) & FORBIDDEN[package]
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


# --------------------------------------------------------------------------- arrows
# The import graph over flare's own modules: which module imports which, resolved to
# the deepest module that exists (``from gpu.frames import FRAME_KEY`` is an edge to
# ``gpu.frames``, ``from actors import Runtime`` one to the ``actors`` face).

PRODUCTION = ("app", "actors", "gpu", "policy", "ops")
MAX_PRODUCTION_LINES = 500


def _arrows_module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _arrows_modules() -> dict[str, pathlib.Path]:
    """Every production module by dotted name."""
    return {_arrows_module_name(path): path
            for package in PRODUCTION for path in sorted((ROOT / package).rglob("*.py"))}


MODULES = _arrows_modules()


def _arrows_statements(tree: ast.Module, *, module_level: bool) -> list[ast.stmt]:
    """The import statements of a module: all of them, or (``module_level``) only those
    that run when it is imported (not in functions, classes or ``if TYPE_CHECKING``)."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    found: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return found


def _arrows_resolve(name: str) -> str | None:
    """The deepest production module ``name`` lies in (None: not flare's)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _arrows_imports(module: str, *, module_level: bool = False) -> set[str]:
    """The production modules ``module`` imports."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _arrows_statements(tree, module_level=module_level):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
        targets.update(t for t in map(_arrows_resolve, names) if t is not None)
    targets.discard(module)
    return targets


def _arrows_graph(*, module_level: bool = False) -> dict[str, set[str]]:
    return {m: _arrows_imports(m, module_level=module_level) for m in MODULES}


def _arrows_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_arrows_gpu_imports_only_policy_descriptors() -> None:
    """gpu reads policy's descriptor types and nothing else of policy (any import,
    also inside functions and under ``TYPE_CHECKING``)."""
    offenders = {m: sorted(t for t in targets if t.split(".")[0] == "policy"
                           and t != "policy.descriptors")
                 for m, targets in _arrows_graph().items() if m.split(".")[0] == "gpu"}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_arrows_app_imports_only_the_actors_face() -> None:
    """app's only flare import is the ``actors`` package face (``actors/__init__.py``)."""
    offenders = {m: sorted(t for t in targets if t.split(".")[0] != "app" and t != "actors")
                 for m, targets in _arrows_graph().items() if m.split(".")[0] == "app"}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


_ARROWS_FACES = {"policy": {"policy"}, "gpu": {"gpu", "gpu.engine"}}
"""The modules through which actors reaches the other packages: each package's face
(``__init__``), and for gpu also ``gpu.engine``, the face that loads a model (torch)."""


def test_arrows_actors_imports_policy_and_gpu_through_their_faces() -> None:
    """actors imports ``policy`` and ``gpu`` only through their faces, so a package's
    inner modules can move without touching the runtime."""
    offenders = {m: sorted(t for t in targets if t.split(".")[0] in _ARROWS_FACES
                           and t not in _ARROWS_FACES[t.split(".")[0]])
                 for m, targets in _arrows_graph().items() if m.split(".")[0] == "actors"}
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_arrows_nothing_outside_ops_and_tests_imports_ops() -> None:
    """Every Python file of the repository outside ``ops/`` and ``tests/`` (production
    packages and any other script) leaves ``ops`` alone."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("ops", "tests") or any(p.startswith(".") for p in rel.parts):
            continue
        if "ops" in imported_roots(path):
            offenders.append(str(rel))
    assert offenders == []


def test_arrows_no_import_cycles() -> None:
    """The module-level imports of the production modules form no cycle (within gpu,
    within each package, or across them); imports inside functions or under
    ``TYPE_CHECKING`` do not count."""
    assert _arrows_cycles(_arrows_graph(module_level=True)) == []


def _arrows_entry_points() -> set[str]:
    """Modules that run without a production importer: package faces, the console
    scripts and other entry points of ``pyproject.toml`` (the ``pytest11`` plugin,
    which pytest loads) and the commands ``ops.cli`` imports by name."""
    import tomllib

    from ops.cli import COMMANDS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    scripts = {target.split(":")[0] for target in project.get("scripts", {}).values()}
    plugins = {target.split(":")[0] for group in project.get("entry-points", {}).values()
               for target in group.values()}
    faces = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    return faces | scripts | plugins | {module for _, module, _ in COMMANDS}


def test_arrows_every_production_module_has_a_production_importer() -> None:
    """No production module is there only for the tests: each is imported by another
    production module or is an entry point."""
    imported = set().union(*_arrows_graph().values())
    orphans = sorted(set(MODULES) - imported - _arrows_entry_points())
    assert orphans == []


def test_arrows_no_production_file_over_500_lines() -> None:
    """Production files stay small enough to read whole: at most 500 lines each."""
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_PRODUCTION_LINES}
    assert long == {}


# --- The repository speaks of the product, and every citation resolves inside it. ---------
#
# Self-contained: helpers and constants of this section are prefixed ``_words_`` / ``_req_``.

_WORDS_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg", ".txt", ".yml", ".yaml"}
_WORDS_NAMES = {"Makefile"}
_WORDS_SKIP_DIRS = ("models/", "tests/policy/data/")
# Each pattern is split across two literals so that this file does not match itself.
_WORDS_PATTERNS = (
    r"\bsess" r"ions? #?\d",
    r"\bsess" r"ion-\d",
    r"\biss" r"ues? #?\d",
    r"(?<!user )(?<!user-)\bag" r"ents?\b",
    r"\ble" r"nt\b",
    r"\$O" r"UT\b",
    r"\bwork" r" periods?\b",
    r"shar" r"ed/(seed|design)",
    r"\.\./sha" r"red\b",
    r"seed-requ" r"irements\.md",
    r"/wo" r"rk/(main|shared|notes)\b",
)


def _words_tracked_text_files() -> list[pathlib.Path]:
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    files = []
    for name in listed:
        if not name or name.startswith(_WORDS_SKIP_DIRS):
            continue
        path = ROOT / name
        if (path.suffix in _WORDS_SUFFIXES or path.name in _WORDS_NAMES) and path.is_file():
            files.append(path)
    return files


def _words_offenders(paths: list[pathlib.Path], root: pathlib.Path) -> list[str]:
    import re

    pattern = re.compile("|".join(f"(?:{p})" for p in _WORDS_PATTERNS), re.IGNORECASE)
    offenders = []
    for path in paths:
        raw = path.read_bytes()
        if b"\0" in raw:
            continue
        for number, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
            match = pattern.search(line)
            if match:
                offenders.append(f"{path.relative_to(root)}:{number}: {match.group(0)!r}")
    return offenders


def test_words_no_development_history_in_tracked_files() -> None:
    """Code, tests, docs and build files speak of the product only: no work-period or
    issue numbers, no talk of who or what developed it, no paths outside the repository."""
    offenders = _words_offenders(_words_tracked_text_files(), ROOT)
    assert offenders == [], "development-history words:\n" + "\n".join(offenders)


def test_words_the_check_sees_each_pattern(tmp_path: pathlib.Path) -> None:
    """The word check is not vacuous: a line with each forbidden form is reported, and
    ordinary uses (an HTTP user agent, "carry", "lenient") are not."""
    samples = ["in sess" "ion 7 we", "see iss" "ue #12", "other ag" "ents ran", "a GPU was le" "nt",
               "logs in $O" "UT", "this work" " period", "`shar" "ed/seed/x.md`",
               "(../sha" "red/design/y.md)"]
    fine = ["the User-Agent header", "a user agent string", "lanes carry their ceilings",
            "a lenient parser", "an HTTP session", "the issuer"]
    path = tmp_path / "sample.md"
    path.write_text("\n".join(samples + fine) + "\n")
    found = [line.split(":", 2)[1] for line in _words_offenders([path], tmp_path)]
    assert found == [str(n) for n in range(1, len(samples) + 1)]


_REQ_FILE = ROOT / "docs" / "design" / "requirements.md"


def _req_defined_ids() -> set[str]:
    import re

    text = _REQ_FILE.read_text()
    rows = re.findall(r"^\| ([A-Z]{2,6}-\d+) \|", text, re.MULTILINE)
    opens = re.findall(r"^- \*\*(OPEN-\d+)\*\*", text, re.MULTILINE)
    return set(rows) | set(opens)


def _req_cited_ids() -> dict[str, list[str]]:
    import re

    defined = _req_defined_ids()
    prefixes = {ident.split("-")[0] for ident in defined}
    cited: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for prefix, digits in re.findall(r"\b([A-Z]{2,6})-(\d+)\b", line):
                if prefix in prefixes:
                    cited.setdefault(f"{prefix}-{digits}", []).append(
                        f"{path.relative_to(ROOT)}:{number}")
            # A test's name cites ids too: ``test_queue_24_...``, ``test_cat_5_cat_7_...``.
            for name in re.findall(r"def (test_\w+)", line):
                for prefix, digits in re.findall(r"_([a-z]{2,6})_(\d+)(?=_|$)", name):
                    if prefix.upper() in prefixes:
                        cited.setdefault(f"{prefix.upper()}-{digits}", []).append(
                            f"{path.relative_to(ROOT)}:{number}")
    return cited


_REQ_NOT_BUILT = "**Not built:**"


def _req_entries(text: str) -> dict[str, str]:
    """Each id's text: a table row, or an ``OPEN-n`` bullet with its indented lines
    (later bullets for the same id, such as its decision, are appended)."""
    import re

    entries: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        start = re.match(r"^\| ([A-Z]{2,6}-\d+) \|", line) \
            or re.match(r"^- \*\*(OPEN-\d+)\*\*", line)
        if start is not None:
            current = start.group(1)
            entries[current] = entries.get(current, "") + line + "\n"
        elif current is not None and line.startswith("  ") and not line.startswith("| "):
            entries[current] += line + "\n"
        else:
            current = None
    return entries


def _req_unaccounted(entries: dict[str, str], cited: set[str]) -> list[str]:
    return sorted(ident for ident, text in entries.items()
                  if ident not in cited and _REQ_NOT_BUILT not in text)


def test_req_every_requirement_is_cited_or_marked_not_built() -> None:
    """Every id of docs/design/requirements.md is cited by a test, or its row says
    ``**Not built:**`` and why."""
    entries = _req_entries(_REQ_FILE.read_text())
    assert len(entries) > 400
    assert _req_unaccounted(entries, set(_req_cited_ids())) == []


def test_req_coverage_check_sees_uncited_and_marked_rows() -> None:
    """The coverage check is not vacuous: an uncited row is reported, a cited one and
    one marked not built are not; an ``OPEN`` bullet's indented lines belong to it."""
    text = ("| AB-1 | cited | policy/ | x |\n| AB-2 | uncited | policy/ | x |\n"
            f"| AB-3 | not there {_REQ_NOT_BUILT} no such thing. | gpu/ | x |\n"
            f"- **OPEN-1** open point\n  continued {_REQ_NOT_BUILT} reason.\n"
            "- **OPEN-2** open point\n\nprose\n")
    entries = _req_entries(text)
    assert sorted(entries) == ["AB-1", "AB-2", "AB-3", "OPEN-1", "OPEN-2"]
    assert _req_unaccounted(entries, {"AB-1"}) == ["AB-2", "OPEN-2"]


def test_req_every_cited_requirement_id_is_defined() -> None:
    """Every requirement id a test cites (``DUR-9``, ``OPEN-24``) is a row of
    docs/design/requirements.md, so ``grep`` from a test leads to its requirement."""
    defined = _req_defined_ids()
    assert len(defined) > 400
    cited = _req_cited_ids()
    assert len(cited) > 100
    unknown = {ident: where for ident, where in cited.items() if ident not in defined}
    assert unknown == {}


def _req_markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _req_broken_links(paths: list[pathlib.Path], root: pathlib.Path) -> list[str]:
    import re

    broken = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue
                where = f"{path.relative_to(root)}:{number}: {target}"
                resolved = (path.parent / target.split("#", 1)[0]).resolve()
                if "shared/" in target or not resolved.is_relative_to(root):
                    broken.append(where + " (outside the repository)")
                elif not resolved.exists():
                    broken.append(where + " (no such file)")
    return broken


def test_req_markdown_links_stay_inside_the_repository() -> None:
    """README and docs link only to files of this repository, and every relative link
    resolves to a file that exists."""
    assert _req_broken_links(_req_markdown_files(), ROOT) == []


def test_req_link_check_reports_escaping_and_missing_targets(tmp_path: pathlib.Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/here.md#part) [web](https://example.org) [anchor](#top)\n"
                    "[out](../elsewhere.md) [shared](../sha" "red/seed/x.md)\n"
                    "[missing](docs/gone.md)\n")
    broken = _req_broken_links([page], tmp_path.resolve())
    assert [entry.split(":")[1] for entry in broken] == ["2", "2", "3"]
