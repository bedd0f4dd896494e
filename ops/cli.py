"""The ``flare`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only wires them together, importing each lazily so
that ``flare --help`` stays fast and one broken command cannot hide the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from ops.failure_line import EXIT_STATUS, failure_line

# (command path, module, one-line help)
COMMANDS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("run",), "ops.run_command", "serve a model (the embedded default with no arguments)"),
    (("rank",), "ops.rank_command",
     "this machine's ranks of a tensor-parallel group served from another (flare run --nnodes)"),
    (("bench", "programs"), "ops.bench_programs", "time every prepared program shape"),
    (("bench", "forward"), "ops.bench_forward",
     "each step program beside the same forward in plain torch (SDPA, contiguous cache)"),
    (("bench", "plan"), "ops.bench_plan", "time the scheduler's plan() and complete()"),
    (("bench", "serve"), "ops.bench_serve", "load-benchmark an OpenAI-compatible streaming endpoint"),
    (("bench", "runtime"), "ops.bench_runtime",
     "device-busy fraction and host gaps of the runtime under decode-heavy load"),
    (("bench", "compare"), "ops.bench_compare",
     "run flare run per scheduling policy on one fixed workload and tabulate side by side"),
    (("bench", "speculation"), "ops.bench_speculation",
     "compare speculation off / fixed depths / adaptive at several loads"),
    (("bench", "checkpoints"), "ops.bench_checkpoints",
     "finish lag and next-turn prefix reuse with terminal captures on and off"),
    (("bench", "peer"), "ops.bench_peer",
     "flare against another OpenAI-compatible server: tokens/s, TTFT and ITL, pair by pair"),
    (("bench", "chaos"), "ops.bench_chaos",
     "hostile clients against a live server: 5xx, hangs, leaks, probe-stream gaps"),
    (("bench", "grammar"), "ops.bench_grammar",
     "structured-output libraries: JSON-schema mask time per token on the served vocabulary"),
    (("bench", "structured"), "ops.bench_structured",
     "output tokens/s with and without a JSON schema at 1 and 8 streams"),
    (("sim",), "ops.sim_command", "simulate scheduling policies on a cost table (no model or device)"),
    (("sim-capacity",), "ops.sim_capacity", "simulated capacity at an SLO of every scheduling configuration"),
    (("train-default",), "ops.train_default", "train the embedded default model pair"),
)


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line, ``flare run: error: ...`` (argparse also prints the
    usage), or one JSON object when the command line asks for ``--log-format json``."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        line = failure_line(f"{message} ({self.prog} --help lists the flags)", prog=self.prog,
                            json_format=self.json_errors, event="cli.usage_error",
                            logger="flare.cli")
        self.exit(EXIT_STATUS, line + "\n")


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether ``argv`` selects ``--log-format json`` (also spelled ``--log-format=json``)."""
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    return any(a == "--log-format=json" or (a, b) == ("--log-format", "json") for a, b in pairs)


def _selected(argv: Sequence[str]) -> tuple[str, ...] | None:
    """The command path that ``argv`` names, if any (e.g. ``("bench", "plan")``)."""
    words = [a for a in argv if not a.startswith("-")]
    for path, _, _ in COMMANDS:
        if tuple(words[: len(path)]) == path:
            return path
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser. Only the module of the command ``argv`` selects is imported (its
    flags are needed); the others appear with their one-line help, so a heavy or broken
    command never slows down or breaks the rest."""
    selected = _selected(argv)
    parser_class = type("Parser", (OneLineParser,), {"json_errors": _wants_json(argv)})
    parser = parser_class(prog="flare", description=__doc__.splitlines()[0])
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, module_name, help_text in COMMANDS:
        holder = top
        for i, word in enumerate(path[:-1]):
            key = " ".join(path[: i + 1])
            if key not in groups:
                group_parser = holder.add_parser(word, help=f"{word} commands")
                groups[key] = group_parser.add_subparsers(dest=f"sub_{i}", required=True)
            holder = groups[key]
        sub = holder.add_parser(path[-1], help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        if path != selected:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            sub.set_defaults(_missing=True)
            continue
        module.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        parser.error(f"'{args.command}' is not available in this build")
    module = importlib.import_module(args._module)
    try:
        return int(module.main(args) or 0)
    except BaseException as exc:
        unavailable = _backend_unavailable(exc)
        if unavailable is None:
            raise
        # e.g. --backend cuda on a machine without a GPU: a message, not a traceback
        print(f"flare: {unavailable}", file=sys.stderr)
        return 2


def _backend_unavailable(exc: BaseException) -> BaseException | None:
    """The ``gpu.backends.BackendUnavailable`` behind ``exc``, also inside the exception
    groups trio's nurseries raise; None when there is none."""
    from gpu.backends import BackendUnavailable
    from ops.failure_line import found_in

    return found_in(exc, (BackendUnavailable,))


if __name__ == "__main__":
    sys.exit(main())
