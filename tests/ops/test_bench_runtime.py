"""``flare bench runtime``'s in-server / isolated interval ratio (the figures' arithmetic;
the run itself needs the model and is the command in docs/runtime.md)."""

from __future__ import annotations

import os

import pytest

from actors.planner_records import FrameRecord
from ops.bench_runtime import in_server_intervals, interval_ratios, single_stream_ratio, tiny
from ops.process_memory import memory_of, serving_memory
from policy import Fence


def frame(fence: int, graph: str, device_ms: float) -> FrameRecord:
    return FrameRecord(fence=Fence(fence), graph=graph, lanes=1, launched_ns=fence * 10**7,
                       observed_ns=fence * 10**7 + 1, device_ns=int(device_ms * 1e6))


def test_in_server_intervals_are_per_graph_means() -> None:
    frames = [frame(1, "decode[B=8]", 8.0), frame(2, "prefill[C=64]", 20.0),
              frame(3, "decode[B=8]", 10.0)]
    assert in_server_intervals(frames) == {"decode[B=8]": (2, pytest.approx(9.0)),
                                           "prefill[C=64]": (1, pytest.approx(20.0))}


def test_ratios_cover_graphs_timed_both_ways_most_run_first() -> None:
    in_server = {"decode[B=8]": (40, 9.0), "prefill[C=64]": (3, 20.0), "decode[B=4]": (5, 4.0)}
    isolated = {"decode[B=8]": 5.0, "prefill[C=64]": 16.0, "decode[B=1]": 2.0}
    rows = interval_ratios(in_server, isolated)
    assert [(r["graph"], r["frames"]) for r in rows] == [("decode[B=8]", 40),
                                                          ("prefill[C=64]", 3)]
    assert rows[0]["ratio"] == pytest.approx(1.8)
    assert rows[1]["ratio"] == pytest.approx(1.25)


def test_process_memory_reads_rss_and_pss_of_this_process() -> None:
    """The memory figures of ``flare bench runtime`` (docs/tensor-parallel.md, *Memory*):
    this process's RSS covers its PSS, both positive; a process that is gone has none."""
    memory = memory_of(os.getpid())
    assert memory is not None and memory["rss"] >= memory["pss"] > 0
    assert serving_memory()["server"].keys() == {"rss", "pss"}
    assert memory_of(2**22 + 1) is None  # above Linux's largest process id


def test_tiny_models_scale_by_hidden_size() -> None:
    shape = tiny(1536).shape
    assert (shape.num_attention_heads, shape.num_key_value_heads,
            shape.intermediate_size) == (48, 24, 4224)
    with pytest.raises(SystemExit, match="multiple of 64"):
        tiny(100)


def test_single_stream_rate_is_over_the_isolated_decode_b1_rate() -> None:
    # decode[B=1] alone: 2.5 ms, 400 tokens/s; a stream at 360 tokens/s is 0.9 of it
    assert single_stream_ratio(360.0, {"decode[B=1]": 2.5}) == pytest.approx(0.9)
    assert single_stream_ratio(360.0, {"decode[B=8]": 5.0}) is None
