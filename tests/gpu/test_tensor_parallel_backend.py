"""The tensor-parallel cpu backend (``gpu.backends.tensor_parallel``): how a group
completion is assembled from its ranks', and the engine's programs on two ranks.

- timing (DUR-14, DUR-15, ACCT-9, OPEN-37): the group completion holds every rank's
  device interval, so a rank reporting a longer interval sets the estimate, a rank
  whose interval is missing (zero) neither lowers it nor, alone, makes it fresh, and
  the readiness correction applies after the ranks are aggregated;
- outputs: rank zero's, plus the peers' under ``PEER_OUTPUTS_KEY`` (ACC-16 is then the
  validator's: ``tests/actors/test_validator_ranks.py``);
- a rank's fault fails the group launch at once, naming the rank;
- on real device processes: prefill and decode frames on two ranks (queued back to
  back) give the tokens of one, with one positive interval per rank.
"""

from __future__ import annotations

from pathlib import Path

from gpu.backends.cpu_process import DeviceLost
from gpu.backends.protocol import Completion, LaunchHandle, ProgramFault
from gpu.backends.tensor_parallel import _Gather, combine
from gpu.frames import PEER_OUTPUTS_KEY, RESULT_KEY
from policy.descriptors import ExecutionTiming, GraphKind, GraphShape
from policy.duration_estimates import DurationEstimates
from policy.service import service_interval_ns
from tests.gpu.test_backend_engine import _run

MS = 1_000_000
DECODE = GraphShape(kind=GraphKind.DECODE, batch_capacity=2, token_capacity=1)


def rank(interval_ns: int, wall_ns: int = 30 * MS, readiness_ns: int = 0,
         result: object = "r") -> Completion:
    return Completion(shape=DECODE, outputs={RESULT_KEY: result}, timing=ExecutionTiming(
        device_intervals_ns=(interval_ns,), wall_ns=wall_ns, readiness_delay_ns=readiness_ns))


def test_a_rank_reporting_a_longer_interval_sets_the_estimate() -> None:
    """DUR-14, ACCT-9: ranks report 5 and 7 ms: the sample and the queued interval are 7."""
    group = combine([rank(5 * MS, wall_ns=20 * MS), rank(7 * MS, wall_ns=25 * MS)])
    assert group.timing.device_intervals_ns == (5 * MS, 7 * MS)
    assert group.timing.wall_ns == 25 * MS
    assert service_interval_ns(group.timing, isolated=False) == 7 * MS
    est = DurationEstimates()
    assert est.observe(DECODE, group.timing.cost_sample_ns, now_ns=0)
    assert est.estimate_ns(DECODE) == 7 * MS


def test_a_missing_rank_interval_neither_lowers_nor_freshens_the_estimate() -> None:
    """DUR-14: a zero interval is no observation: with a positive peer the sample is the
    peer's; with none it makes nothing fresh."""
    assert combine([rank(0), rank(6 * MS)]).timing.cost_sample_ns == 6 * MS
    est = DurationEstimates()
    assert not est.observe(DECODE, combine([rank(0), rank(0)]).timing.cost_sample_ns,
                           now_ns=0)
    assert not est.is_known(DECODE)


def test_readiness_correction_follows_the_aggregation() -> None:
    """DUR-15: max interval 9 ms with a 2 ms readiness delay -> sample 7 ms."""
    group = combine([rank(9 * MS, readiness_ns=2 * MS), rank(4 * MS)])
    assert group.timing.cost_sample_ns == 7 * MS


def test_outputs_are_rank_zeros_with_the_peers_beside() -> None:
    group = combine([rank(1, result="zero"), rank(1, result="one"), rank(1, result="two")])
    assert group.outputs[RESULT_KEY] == "zero"
    assert [p[RESULT_KEY] for p in group.outputs[PEER_OUTPUTS_KEY]] == ["one", "two"]


def test_a_rank_fault_fails_the_group_launch_at_once_naming_the_rank() -> None:
    """A lost rank stops the group and fails the launch without waiting for rank 0."""
    lost: list[tuple[int, BaseException]] = []

    def on_lost(rank: int, cause: BaseException) -> DeviceLost:
        lost.append((rank, cause))
        return DeviceLost(f"group stopped: rank {rank}: {cause}")

    group = LaunchHandle(DECODE, sequence=0, launched_ns=0)
    gather = _Gather(group, 2, on_lost)
    peer = LaunchHandle(DECODE, sequence=0, launched_ns=0)
    peer.set_fault(ProgramFault(DECODE, "device", DeviceLost("was killed by SIGKILL")))
    gather.rank_done(1, peer)
    assert group.done()  # rank 0 has not answered: nobody waits for it
    try:
        group.result()
    except ProgramFault as fault:
        assert isinstance(fault.cause, DeviceLost)
        assert "rank 1" in str(fault) and "SIGKILL" in str(fault)
    else:
        raise AssertionError("the group launch did not fail")
    assert [rank for rank, _ in lost] == [1]
    late = LaunchHandle(DECODE, sequence=0, launched_ns=0)
    late.set_completion(rank(5))
    gather.rank_done(0, late)  # a late rank changes nothing
    assert group.done()


def test_two_ranks_run_the_engines_programs_as_one(tiny_checkpoints: dict[str, Path]) -> None:
    """OPEN-37: the same frames on one and on two ranks give the same tokens; each
    group completion carries a positive interval per rank and the peer's outputs."""
    completions: list[Completion] = []
    one, _ = _run(tiny_checkpoints["llama"], queued=True)
    two, _ = _run(tiny_checkpoints["llama"], queued=True, tensor_parallel=2,
                  completions=completions)
    assert two == one and len(completions) == 3
    for completion in completions:
        assert len(completion.timing.device_intervals_ns) == 2
        assert all(d > 0 for d in completion.timing.device_intervals_ns)
        assert len(completion.outputs[PEER_OUTPUTS_KEY]) == 1


def test_a_bind_fault_fails_the_launch_alone() -> None:
    """A frame that does not fit fails in bind on every rank, before any collective:
    the group keeps serving."""
    lost: list[int] = []
    group = LaunchHandle(DECODE, sequence=0, launched_ns=0)
    gather = _Gather(group, 2, lambda rank, cause: lost.append(rank) or DeviceLost("x"))
    for r in (0, 1):
        handle = LaunchHandle(DECODE, sequence=0, launched_ns=0)
        handle.set_fault(ProgramFault(DECODE, "bind", ValueError("row 9 out of range")))
        gather.rank_done(r, handle)
    assert lost == []
    try:
        group.result()
    except ProgramFault as fault:
        assert isinstance(fault.cause, ValueError) and fault.stage == "bind"
    else:
        raise AssertionError("the group launch did not fail")
