"""``flare bench chaos``: hostile clients against a live server, and the figures.

Starts ``flare run`` on a free loopback port (with a throwaway API key, so that the
key checks are exercised too) or targets ``--url`` of a running server, and runs, in
order: the bad-input battery (``ops.chaos.cases``), a disconnect storm, an overload
burst, slow readers, maximal-body abuse under a probe stream, a short soak and an idle
keep-alive check (``ops.chaos.phases`` and ``ops.chaos.streams``). Before and after
it reads the server's RSS, descriptors and TCP connections from ``/proc`` (a server it
started, or ``--pid``) or from ``process_*`` metrics, and counts the lines of the
started server's log that show prompt text. It prints a table of figures and
one PASS/FAIL line per target, and with ``--json PATH`` writes them all.

Traffic goes only to loopback; every phase is bounded in count and time, and the run
stops by itself (``--time-limit`` bounds the whole). The exit status is 0 whatever the
figures say (they are the verdict); 1 if the server cannot be started or the run
passes ``--time-limit``, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import pathlib
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import fields, replace
from urllib.parse import urlsplit

import httpx
import trio

from app.service import DEFAULT_MAX_REQUEST_BYTES
from ops import launch
from ops.bench_compare import start_server
from ops.chaos.cases import CANARY
from ops.chaos.phases import Endpoint, Observe
from ops.chaos.report import ChaosReport, render
from ops.chaos.run import PHASES, QUICK, SIZE_FIELDS, Sizes, run_chaos
from ops.chaos.server_process import Snapshot, from_metrics, snapshot

SIZE_HELP = {
    "battery_concurrency": "battery cases in flight at once",
    "storm_waves": "disconnect-storm waves", "storm_clients": "clients per storm wave",
    "storm_tokens": "max_tokens of each storm stream",
    "burst": "concurrent requests of the overload burst (keep above the server's "
             "--max-queue plus --max-batch)",
    "burst_tokens": "max_tokens of each burst request",
    "slow_readers": "clients that start a stream and never read",
    "slow_hold_s": "seconds the slow readers hold their connections",
    "slow_tokens": "max_tokens of each slow reader's stream",
    "probe_tokens": "tokens of the probe stream (idle and under abuse)",
    "abuse_bodies": "most maximal bodies sent while the probe runs",
    "abuse_bytes": "bytes of each abusive body (0: just under --max-request-bytes)",
    "abuse_time_s": "longest the probe under abuse is measured",
    "soak_requests": "ordinary requests of the soak", "soak_concurrency": "soak clients",
    "soak_tokens": "max_tokens of each soak request",
    "idle_connections": "keep-alive connections left idle after one answer",
    "idle_timeout_s": "seconds the server has to close an idle connection",
    "settle_s": "longest wait after the run for resources to come back",
}
DEFAULT_SERVER_ARGS = "--eager-forward --log-level warning --shutdown-grace 5"
QUICK_SERVER_ARGS = "--max-queue 8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="a running server on loopback (default: start flare run)")
    parser.add_argument("--pid", type=int, default=None,
                        help="with --url: the server's process id, for /proc figures")
    parser.add_argument("--api-key", default=os.environ.get("FLARE_API_KEY"),
                        help="with --url: the server's key (env FLARE_API_KEY)")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                        help="flags for the flare run it starts (one string)")
    parser.add_argument("--server-log", type=pathlib.Path, default=None,
                        help="where the started server logs (default: a temporary file)")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="the server's body size limit (maximal bodies are sized by it)")
    parser.add_argument("--request-timeout", type=float, default=20.0,
                        help="seconds without an answer that make a request a hang")
    parser.add_argument("--close-timeout", type=float, default=5.0,
                        help="seconds the server has to close a connection it was asked to")
    parser.add_argument("--time-limit", type=float, default=900.0,
                        help="bound on the whole run in seconds")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes for a run of well under a minute (tests)")
    sizes = parser.add_argument_group("phase sizes (defaults: a full run; --quick: smaller)")
    for f in fields(Sizes):
        if f.name in SIZE_FIELDS:
            sizes.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                               default=None, help=f"{SIZE_HELP[f.name]} (default {f.default}, "
                                                  f"quick {getattr(QUICK, f.name)})")
    parser.add_argument("--json", type=pathlib.Path, default=None, metavar="PATH",
                        help="also write every figure and verdict as JSON")


def sizes_from(args: argparse.Namespace) -> Sizes:
    base = QUICK if args.quick else Sizes()
    given = {name: getattr(args, name) for name in SIZE_FIELDS if getattr(args, name) is not None}
    return replace(base, **given)


def loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def observer(pid: int | None, ep: Endpoint) -> Observe:
    """Reads the server's resources: ``/proc`` of ``pid``, else its ``process_*`` metrics
    (None when it exports none)."""

    async def observe() -> Snapshot | None:
        if pid is not None:
            return snapshot(pid)
        async with ep.client() as http:
            try:
                response = await http.get("/metrics")
            except httpx.HTTPError:
                return None
        found = from_metrics(response.text) if response.status_code == 200 else None
        return found if found is not None and found.rss_bytes is not None else None

    return observe


def run(args: argparse.Namespace, host: str, port: int, api_key: str | None,
        pid: int | None, phases: tuple[str, ...]) -> ChaosReport:
    ep = Endpoint(host=host, port=port, api_key=api_key, request_timeout_s=args.request_timeout,
                  close_timeout_s=args.close_timeout, max_request_bytes=args.max_request_bytes)
    sizes = sizes_from(args)

    def progress(name: str) -> None:
        print(f"chaos: {name}", file=sys.stderr, flush=True)

    async def bounded() -> ChaosReport:
        with trio.fail_after(args.time_limit):
            return await run_chaos(ep, sizes, observer(pid, ep), phases=phases,
                                   progress=progress)

    try:
        report = trio.run(bounded)
    except trio.TooSlowError:
        raise RuntimeError(f"the run did not end within --time-limit {args.time_limit:g} s"
                           ) from None
    report.config = {"sizes": {name: getattr(sizes, name) for name in SIZE_FIELDS},
                     "quick": sizes.quick, "request_timeout_s": args.request_timeout,
                     "close_timeout_s": args.close_timeout,
                     "max_request_bytes": args.max_request_bytes, "phases": list(phases)}
    return report


def lines_with(path: pathlib.Path, marker: str) -> int | None:
    """Lines of ``path`` that contain ``marker`` (None: unreadable)."""
    try:
        with path.open("rb") as f:
            return sum(marker.encode() in line for line in f)
    except OSError:
        return None


def main(args: argparse.Namespace) -> int:
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        print(f"flare bench chaos: unknown phases {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.url is not None:
        parts = urlsplit(args.url)
        if parts.scheme != "http" or not parts.hostname or not loopback(parts.hostname):
            print("flare bench chaos: --url must be http:// on a loopback address",
                  file=sys.stderr)
            return 2
        try:
            report = run(args, parts.hostname, parts.port or 80, args.api_key, args.pid, phases)
        except RuntimeError as exc:
            print(f"flare bench chaos: {exc}", file=sys.stderr)
            return 1
        server_note = ""
    else:
        port, key = launch.free_port(), secrets.token_hex(12)
        extra = [*args.server_args.split(), *(QUICK_SERVER_ARGS.split() if args.quick else ()),
                 "--api-key", key]
        log = args.server_log or pathlib.Path(tempfile.gettempdir()) / f"flare-chaos-{port}.log"
        started = time.monotonic()
        try:
            proc = start_server("balanced", port, extra, log, args.startup_timeout)
        except RuntimeError as exc:
            print(f"flare bench chaos: {exc}", file=sys.stderr)
            return 1
        startup_s = round(time.monotonic() - started, 1)
        try:
            report = run(args, "127.0.0.1", port, key, proc.pid, phases)
        except RuntimeError as exc:
            print(f"flare bench chaos: {exc}; server log: {log}", file=sys.stderr)
            return 1
        finally:
            launch.stop(proc)
        report.config["server"] = {
            "args": [*extra[:-1], "<key>"], "startup_s": startup_s,
            "exit_status_after_sigterm": proc.returncode, "log": str(log),
            "log_lines_with_prompt_text": lines_with(log, CANARY)}
        server_note = f"\nserver log: {log} (exit status {proc.returncode} after SIGTERM)"
    print(render(report) + server_note)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="flare bench chaos", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))

