"""``flare bench chaos``: the battery's cases, the raw HTTP client, the ``/proc`` reader,
the verdicts and the printed report; and one ``--quick`` run against a started server.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
from functools import partial

import pytest
import trio
import trio.testing

from ops import bench_chaos, cli
from ops.chaos import cases, server_process, wire
from ops.chaos.report import ChaosReport, PhaseResult, render, verdicts
from ops.chaos.run import PHASES, QUICK, Sizes
from ops.chaos.server_process import Snapshot
from ops.chaos.streams import per_body

TARGET = cases.CaseTarget(host="127.0.0.1:8000", api_key="k", max_request_bytes=64 * 1024)
FRAMING_CASES = {"http: length not a number", "http: two lengths", "http: chunked",
                 "http: bad chunk size", "http: garbage request line",
                 "http: declared length over the limit", "oversized: chunked body"}


def _split(request: bytes) -> tuple[list[bytes], bytes]:
    head, sep, body = request.partition(b"\r\n\r\n")
    assert sep, "a request head ends with an empty line"
    return head.split(b"\r\n"), body


def test_every_case_is_one_named_request_with_a_known_expectation() -> None:
    battery = cases.battery(TARGET)
    names = [c.name for c in battery]
    assert len(names) == len(set(names))
    assert len(battery) > 600
    for case in battery:
        assert case.expect in ("2xx", "4xx", "any")
        lines, body = _split(case.request)
        if case.name == "http: garbage request line":
            continue
        method, path, version = lines[0].split(b" ")
        assert version in (b"HTTP/1.0", b"HTTP/1.1") and path.startswith(b"/")
        lengths = [line for line in lines if line.lower().startswith(b"content-length:")]
        if case.name not in FRAMING_CASES and method == b"POST":
            assert lengths == [b"Content-Length: %d" % len(body)], case.name


def test_field_cases_put_every_value_into_every_parameter_as_raw_json() -> None:
    field_cases = cases.field_cases(TARGET)
    per_route = {path: len(fields) * len(cases.BAD_VALUES) for path, fields in cases.FIELDS.items()}
    assert len(field_cases) == sum(per_route.values())
    for case in field_cases:
        _, _, rest = case.name.partition("/")
        field, _, label = rest.partition("=")
        body = json.loads(_split(case.request)[1])  # NaN, 1e999 and "\ud800" parse in Python
        assert field in body
        raw = dict(cases.BAD_VALUES)[label]
        assert f'"{field}": {raw}'.encode() in case.request
    surrogates = [c for c in field_cases if c.name.endswith("=surrogate")]
    assert surrogates and all(c.expect == "4xx" for c in surrogates)
    booleans = [c for c in field_cases if c.name.endswith(("/n=true", "/max_tokens=false"))]
    assert len(booleans) == 4 and all(c.expect == "4xx" for c in booleans)


def test_maximal_bodies_are_just_under_the_limit_and_oversized_ones_over() -> None:
    limit = TARGET.max_request_bytes
    for body in (cases.maximal_prompt(limit), cases.maximal_chat(limit),
                 cases.maximal_ids(limit)):
        assert limit - 8192 <= len(body) <= limit
        json.loads(body)
    assert len(json.loads(cases.maximal_chat(4 * 2**20))["messages"]) == 2048
    heavy = {c.name: c for c in cases.heavy_cases(TARGET)}
    assert len(_split(heavy["oversized: body"].request)[1]) > limit
    assert all(c.heavy for c in heavy.values())


def test_quick_battery_is_a_subset_without_maximal_bodies() -> None:
    full = {c.name for c in cases.battery(TARGET)}
    quick = cases.battery(TARGET, quick=True)
    assert {c.name for c in quick} < full
    assert not any(c.heavy for c in quick)
    assert sum(c.closes for c in quick) == 5


def test_auth_cases_expect_a_refusal_only_when_the_server_has_a_key() -> None:
    keyed = [c for c in cases.battery(TARGET) if c.name.startswith("auth:")]
    open_server = cases.CaseTarget(host="h", api_key=None)
    unkeyed = [c for c in cases.battery(open_server, quick=True) if c.name.startswith("auth:")]
    assert keyed and all(c.expect == "4xx" for c in keyed)
    assert unkeyed and all(c.expect == "any" for c in unkeyed)
    assert all(b"Bearer k\r\n" not in c.request for c in keyed)


async def _answer(server: trio.abc.Stream, response: bytes, *, close: bool) -> None:
    await server.receive_some()
    await server.send_all(response)
    if close:
        await server.aclose()
    else:
        await trio.sleep_forever()


async def _exchange(response: bytes | None, *, close: bool, request: bytes = b"GET / HTTP/1.1"
                    b"\r\nHost: h\r\n\r\n", want_close: bool = False) -> wire.Exchange:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        if response is not None:
            nursery.start_soon(partial(_answer, server, response, close=close))
        got = await wire.exchange_on(client, request, timeout_s=20, close_timeout_s=5,
                                     want_close=want_close)
        nursery.cancel_scope.cancel()
    return got


JSON_400 = b"HTTP/1.1 400 Bad\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def test_a_length_framed_answer_and_the_close_that_follows(
        autojump_clock: trio.testing.MockClock) -> None:
    closed = await _exchange(JSON_400, close=True, want_close=True)
    kept = await _exchange(JSON_400, close=False, want_close=True)
    assert (closed.status, closed.body, closed.hang, closed.closed) == (400, b"{}", False, True)
    assert (kept.status, kept.hang, kept.closed) == (400, False, False)
    assert kept.headers["content-type"] == "application/json"


async def test_silence_is_a_hang_and_a_close_without_answer_is_a_drop(
        autojump_clock: trio.testing.MockClock) -> None:
    silent = await _exchange(None, close=False)
    dropped = await _exchange(b"", close=True)
    assert (silent.status, silent.hang) == (None, True)
    assert silent.seconds >= 20
    assert (dropped.status, dropped.hang) == (None, False)


async def test_chunked_answers_and_100_continue_are_read_whole(
        autojump_clock: trio.testing.MockClock) -> None:
    response = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked"
                b"\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    got = await _exchange(response, close=False)
    assert (got.status, got.body, got.hang, got.closed) == (200, b"abcde", False, None)


async def test_an_http_1_0_stream_is_complete_at_done_and_must_then_close(
        autojump_clock: trio.testing.MockClock) -> None:
    stream = (b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
              b"data: {}\n\ndata: [DONE]\n\n")
    kept = await _exchange(stream, close=False)
    closed = await _exchange(stream, close=True)
    assert (kept.status, kept.hang, kept.closed) == (200, False, False)
    assert (closed.status, closed.hang, closed.closed) == (200, False, True)
    assert closed.body.endswith(b"data: [DONE]\n\n")


async def test_a_refused_connection_is_a_drop_not_a_hang() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, never listening: connections are refused
        got = await wire.exchange("127.0.0.1", port, b"GET / HTTP/1.1\r\n\r\n", timeout_s=5)
    assert (got.status, got.hang) == (None, False)


def test_parse_head_reads_status_and_lowercases_names() -> None:
    assert wire.parse_head(b"HTTP/1.1 431 \r\nContent-Length: 0") == (431, {"content-length": "0"})
    assert wire.parse_head(b"garbage") is None


def test_tcp_states_count_only_the_process_sockets_and_leave_listeners_out() -> None:
    table = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
             "timeout inode\n"
             "   0: 0100007F:1F40 00000000:0000 0A 0:0 00:0 0 0 0 11 1\n"
             "   1: 0100007F:1F40 0100007F:C350 01 0:0 00:0 0 0 0 12 1\n"
             "   2: 0100007F:1F40 0100007F:C351 08 0:0 00:0 0 0 0 13 1\n"
             "   3: 0100007F:1F40 0100007F:C352 01 0:0 00:0 0 0 0 99 1\n")
    assert server_process.tcp_states(table, {"11", "12", "13"}) == {
        "ESTABLISHED": 1, "CLOSE_WAIT": 1}


def test_snapshot_of_this_process_sees_its_own_connections() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client:
        accepted, _ = listener.accept()
        with accepted:
            now = server_process.snapshot(os.getpid())
            assert client.fileno() >= 0
    assert now.rss_bytes is not None and now.rss_bytes > 0
    assert now.fds is not None and now.fds >= 3
    assert now.connections.get("ESTABLISHED", 0) >= 2  # both ends are ours
    assert now.cpu_s is not None and now.cpu_s > 0
    gone = server_process.snapshot(2**22 + 12345)  # no such process
    assert gone.fds is None and gone.cpu_s is None


def test_process_metrics_are_read_from_prometheus_text() -> None:
    text = ("# HELP process_open_fds x\nprocess_open_fds 17.0\n"
            "process_resident_memory_bytes 1.5e+08\nprocess_cpu_seconds_total 2.5\n")
    found = server_process.from_metrics(text)
    assert (found.rss_bytes, found.fds, found.cpu_s) == (150_000_000, 17, 2.5)


def test_server_cpu_per_body_is_the_abused_probe_s_cpu_beyond_the_idle_one() -> None:
    # idle probe: 1.0 -> 1.5 s; abused probe: 1.5 -> 2.3 s; 3 bodies: 0.3 s / 3
    assert per_body(1.0, 1.5, 2.3, 3) == 100.0
    assert per_body(1.0, 1.5, 1.9, 3) == 0.0  # cheaper than idle: nothing to charge
    assert per_body(None, 1.5, 2.3, 3) is None and per_body(1.0, 1.5, 2.3, 0) is None


def _report(*, five_xx: int = 0, hangs: int = 0, ratio: float | None = 1.5,
            rss_after: int = 100, fds_after: int = 20, open_after: int = 0,
            not_closed: int = 0) -> ChaosReport:
    battery = PhaseResult("battery", outcomes={"400": 10, "200": 3},
                          figures={"not_closed_when_asked": not_closed, "unexpected": 0})
    if five_xx:
        battery.outcomes["500"] = five_xx
    if hangs:
        battery.outcomes["hang"] = hangs
    abuse = PhaseResult("abuse", outcomes={"200": 2},
                        figures={"ratio": ratio, "idle_p99_ms": 10.0, "abuse_p99_ms": 15.0})
    return ChaosReport(target="http://127.0.0.1:1", phases=[battery, abuse],
                       before=Snapshot(rss_bytes=100, fds=20),
                       after=Snapshot(rss_bytes=rss_after, fds=fds_after,
                                      connections={"CLOSE_WAIT": open_after} if open_after
                                      else {}))


def _statuses(report: ChaosReport) -> list[str]:
    return [v.status for v in verdicts(report)]


def test_a_clean_run_passes_every_target() -> None:
    assert _statuses(_report()) == ["PASS"] * 6


@pytest.mark.parametrize(("kwargs", "failed"), [
    ({"five_xx": 1}, 0), ({"hangs": 2}, 1), ({"ratio": 3.01}, 2), ({"rss_after": 106}, 3),
    ({"fds_after": 22}, 4), ({"open_after": 1}, 5), ({"not_closed": 1}, 5)])
def test_each_target_fails_on_its_own_figure(kwargs: dict[str, float], failed: int) -> None:
    statuses = _statuses(_report(**kwargs))  # type: ignore[arg-type]
    assert statuses[failed] == "FAIL"
    assert statuses.count("FAIL") == 1


def test_limits_are_inclusive_and_shrinking_resources_pass() -> None:
    assert _statuses(_report(ratio=3.0, rss_after=105, fds_after=10)) == ["PASS"] * 6


def test_unmeasured_figures_are_not_applicable_never_a_pass() -> None:
    report = _report(ratio=None)
    report.before = report.after = None
    report.phases[0].figures.pop("not_closed_when_asked")
    assert _statuses(report)[2:] == ["n/a"] * 4


def test_render_prints_the_figures_the_phases_and_a_line_per_target() -> None:
    report = _report(five_xx=2)
    report.phases[0].figures["unexpected_cases"] = ["completions/n=true: 4xx -> 200"]
    text = render(report)
    assert "| 5xx answers (all phases) | 2 |" in text
    assert "| battery | 15 | 2xx 3, 4xx 10, 5xx 2 |" in text
    assert "completions/n=true: 4xx -> 200" in text
    assert "FAIL  no 5xx: 2" in text and "PASS  no hangs: 0" in text
    assert "| probe p99 gap idle / abuse / ratio | 10.0 ms / 15.0 ms / 1.50x |" in text
    body = json.loads(json.dumps(report.to_json()))
    assert body["totals"]["server_errors"] == 2 and len(body["verdicts"]) == 6


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_chaos.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_quick_preset_and_flags_size_the_phases() -> None:
    assert bench_chaos.sizes_from(_args()) == Sizes()
    quick = bench_chaos.sizes_from(_args("--quick", "--burst", "7", "--slow-hold-s", "0.5"))
    assert quick.quick and quick.burst == 7 and quick.slow_hold_s == 0.5
    assert quick.storm_waves == QUICK.storm_waves


def test_only_loopback_targets_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_chaos.loopback("127.0.0.1") and bench_chaos.loopback("::1")
    assert not bench_chaos.loopback("10.1.2.3")
    assert bench_chaos.main(_args("--url", "http://10.1.2.3:8000")) == 2
    assert bench_chaos.main(_args("--phases", "battery,nope")) == 2
    assert "loopback" in capsys.readouterr().err


def test_the_command_is_registered() -> None:
    args = cli.build_parser(["bench", "chaos", "--quick"]).parse_args(["bench", "chaos", "--quick"])
    assert args._module == "ops.bench_chaos" and args.quick


@pytest.mark.slow
def test_a_quick_run_against_a_started_server_reports_every_phase(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chaos.json"
    args = _args("--quick", "--json", str(out), "--server-log", str(tmp_path / "server.log"),
                 "--request-timeout", "15", "--time-limit", "300")
    assert bench_chaos.main(args) == 0
    report = json.loads(out.read_text())
    assert [p["name"] for p in report["phases"]] == [
        "battery", "storm", "burst", "slow readers", "abuse", "soak", "idle"]
    assert len(PHASES) == len(report["phases"])
    battery = report["phases"][0]
    assert battery["requests"] == len(cases.battery(cases.CaseTarget(host="h", api_key="k"),
                                                    quick=True))
    assert report["server"]["before"]["rss_bytes"] > 0
    assert report["phases"][2]["outcomes"].get("429", 0) > 0  # beyond the quick queue of 8
    assert [v["status"] in ("PASS", "FAIL") for v in report["verdicts"]] == [True] * 6
    printed = capsys.readouterr().out
    assert printed.count("PASS ") + printed.count("FAIL ") == 6


def test_log_lines_showing_prompt_text_are_counted(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"request id=1 size=40\nprompt='def " + cases.CANARY.encode() + b"('\nok\n")
    assert bench_chaos.lines_with(log, cases.CANARY) == 1
    assert bench_chaos.lines_with(tmp_path / "missing.log", cases.CANARY) is None
    bases = (cases.json_object(cases.BASES[path]) for path in (cases.COMPLETIONS, cases.CHAT))
    assert all(cases.CANARY.encode() in body for body in bases)
