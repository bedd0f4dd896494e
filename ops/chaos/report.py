"""Figures, verdicts and the printed table of a chaos run (pure: no I/O, no clocks).

Every phase records how its requests ended (``outcomes``: an HTTP status, ``hang`` for
no complete answer within the request timeout, ``dropped`` for a connection the server
closed or reset without answering) and its own figures. The verdicts are the targets:
no 5xx, no hangs, the probe stream's p99 inter-token gap during maximal-body abuse at
most ``PROBE_RATIO_LIMIT`` times its idle value, RSS and descriptors back to at most
``RESOURCE_TOLERANCE`` above their starting values (below is fine), and every
connection closed within its timeout. A figure that could not be measured (no server
process to read) gives ``n/a``, never a pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ops.chaos.server_process import Snapshot

PROBE_RATIO_LIMIT = 3.0
RESOURCE_TOLERANCE = 0.05
Outcome = str  # "200", "429", ..., "hang", "dropped"
VerdictStatus = Literal["PASS", "FAIL", "n/a"]


@dataclass(slots=True)
class PhaseResult:
    name: str
    outcomes: dict[Outcome, int] = field(default_factory=dict)
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    def add(self, outcome: Outcome | int | None, *, hang: bool = False) -> None:
        key = "hang" if hang else ("dropped" if outcome is None else str(outcome))
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    @property
    def server_errors(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.startswith("5"))

    @property
    def hangs(self) -> int:
        return self.outcomes.get("hang", 0)

    def by_class(self) -> dict[str, int]:
        """Outcomes by status class (``2xx``, ``4xx``, ...), hangs and drops apart."""
        classes: dict[str, int] = {}
        for key, n in self.outcomes.items():
            name = f"{key[0]}xx" if key.isdigit() else key
            classes[name] = classes.get(name, 0) + n
        return dict(sorted(classes.items()))


@dataclass(frozen=True, slots=True)
class Verdict:
    target: str
    status: VerdictStatus
    measured: str


@dataclass(slots=True, kw_only=True)
class ChaosReport:
    target: str
    phases: list[PhaseResult]
    before: Snapshot | None = None
    after: Snapshot | None = None
    peak: Snapshot | None = None
    settle_seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)

    def phase(self, name: str) -> PhaseResult | None:
        return next((p for p in self.phases if p.name == name), None)

    def figure(self, phase: str, key: str) -> Any:
        found = self.phase(phase)
        return None if found is None else found.figures.get(key)

    @property
    def server_errors(self) -> int:
        return sum(p.server_errors for p in self.phases)

    @property
    def hangs(self) -> int:
        return sum(p.hangs for p in self.phases)

    def connections_left_open(self) -> int | None:
        """Connections the server kept past their timeout: battery cases that asked for a
        close, idle keep-alive connections, and server sockets still open after the run."""
        counts = [self.figure("battery", "not_closed_when_asked"),
                  self.figure("idle", "not_closed")]
        if self.after is not None and self.after.fds is not None:
            counts.append(self.after.open_connections)
        known = [c for c in counts if c is not None]
        return sum(known) if known else None

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target, "config": self.config,
            "phases": [{"name": p.name, "requests": p.requests, "outcomes": p.outcomes,
                        "by_class": p.by_class(), "seconds": p.seconds, "figures": p.figures}
                       for p in self.phases],
            "server": {"before": _snap(self.before), "after": _snap(self.after),
                       "peak": _snap(self.peak), "settle_seconds": self.settle_seconds},
            "totals": {"server_errors": self.server_errors, "hangs": self.hangs,
                       "connections_left_open": self.connections_left_open()},
            "verdicts": [asdict(v) for v in verdicts(self)],
        }


def _snap(s: Snapshot | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"rss_bytes": s.rss_bytes, "fds": s.fds, "connections": s.connections}


def _rss(s: Snapshot | None) -> int | None:
    return None if s is None else s.rss_bytes


def _fds(s: Snapshot | None) -> int | None:
    return None if s is None else s.fds


def change(before: float | None, after: float | None) -> float | None:
    """Relative change ``after / before - 1`` (None when either is unknown)."""
    if before is None or after is None or before <= 0:
        return None
    return after / before - 1.0


def _bounded(name: str, value: float | None, limit: float, shown: str) -> Verdict:
    if value is None:
        return Verdict(name, "n/a", shown)
    return Verdict(name, "PASS" if value <= limit + 1e-9 else "FAIL", shown)  # 105/100 - 1


def verdicts(report: ChaosReport) -> list[Verdict]:
    before, after = report.before, report.after
    rss = change(_rss(before), _rss(after))
    fds = change(_fds(before), _fds(after))
    ratio = report.figure("abuse", "ratio")
    left = report.connections_left_open()
    tolerance = f"{RESOURCE_TOLERANCE:.0%}"
    return [
        _bounded("no 5xx", report.server_errors, 0, str(report.server_errors)),
        _bounded("no hangs", report.hangs, 0, str(report.hangs)),
        _bounded(f"probe p99 gap during abuse <= {PROBE_RATIO_LIMIT:g}x idle", ratio,
                 PROBE_RATIO_LIMIT, _num(ratio, "x")),
        _bounded(f"RSS back within {tolerance}", rss, RESOURCE_TOLERANCE, _pct(rss)),
        _bounded(f"descriptors back within {tolerance}", fds, RESOURCE_TOLERANCE, _pct(fds)),
        _bounded("every connection closed within its timeout", left, 0,
                 "-" if left is None else str(left)),
    ]


def _num(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MB"


def _int(value: int | None) -> str:
    return "-" if value is None else str(value)


def figure_rows(report: ChaosReport) -> list[tuple[str, str]]:
    """The headline figures as (name, value) rows."""
    b, a, peak = report.before, report.after, report.peak
    battery = report.phase("battery")
    storm_in_flight = report.figure("storm", "in_flight_after")
    return [
        ("battery cases tried", _int(None if battery is None else battery.requests)),
        ("battery answers not as expected", _int(report.figure("battery", "unexpected"))),
        ("error answers without a JSON body", _int(report.figure("battery", "error_not_json"))),
        ("5xx answers (all phases)", str(report.server_errors)),
        ("hangs (all phases)", str(report.hangs)),
        ("RSS before / after / change", f"{_mb(_rss(b))} / {_mb(_rss(a))} / "
                                        f"{_pct(change(_rss(b), _rss(a)))}"),
        ("RSS peak", _mb(_rss(peak))),
        ("descriptors before / after / change", f"{_int(_fds(b))} / {_int(_fds(a))} / "
                                                f"{_pct(change(_fds(b), _fds(a)))}"),
        ("descriptors peak", _int(_fds(peak))),
        ("probe p99 gap idle / abuse / ratio",
         f"{_num(report.figure('abuse', 'idle_p99_ms'), ' ms', 1)} / "
         f"{_num(report.figure('abuse', 'abuse_p99_ms'), ' ms', 1)} / "
         f"{_num(report.figure('abuse', 'ratio'), 'x')}"),
        ("serving-process CPU per abusive body",
         _num(report.figure("abuse", "server_cpu_ms_per_body"), " ms", 1)),
        ("requests in flight after the storm", _int(storm_in_flight)),
        ("429 without Retry-After", _int(report.figure("burst", "retry_after_missing"))),
        ("connections left open", _int(report.connections_left_open())),
        ("server sockets open after the run", _states(a)),
        ("settle time after the run", f"{report.settle_seconds:.1f} s"),
        ("server log lines with prompt text",
         _int(report.config.get("server", {}).get("log_lines_with_prompt_text"))),
    ]


def _states(s: Snapshot | None) -> str:
    if s is None or s.fds is None:
        return "-"
    if not s.connections:
        return "0"
    return ", ".join(f"{n} {state}" for state, n in sorted(s.connections.items()))


def markdown(rows: Iterable[tuple[str, ...]], headers: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render(report: ChaosReport) -> str:
    """The figures table, the per-phase table and one PASS/FAIL line per target."""
    lines = [f"flare bench chaos against {report.target}", ""]
    lines += markdown(figure_rows(report), ("figure", "value"))
    lines.append("")
    phase_rows = [(p.name, str(p.requests),
                   ", ".join(f"{k} {n}" for k, n in p.by_class().items()) or "-",
                   f"{p.seconds:.1f}") for p in report.phases]
    lines += markdown(phase_rows, ("phase", "requests", "outcomes", "seconds"))
    unexpected = report.figure("battery", "unexpected_cases") or []
    if unexpected:
        lines += ["", "battery answers not as expected (case: expected -> got):"]
        lines += [f"  {item}" for item in unexpected]
    not_json = report.figure("battery", "error_not_json_cases") or []
    if not_json:
        lines += ["", "error answers without a JSON body (case: status):"]
        lines += [f"  {item}" for item in not_json]
    lines.append("")
    lines += [f"{v.status:4}  {v.target}: {v.measured}" for v in verdicts(report)]
    return "\n".join(lines)
