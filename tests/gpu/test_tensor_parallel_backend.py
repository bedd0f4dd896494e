"""The tensor-parallel cpu backend (``gpu.backends.tensor_parallel``,
``gpu.backends.rank_worker``): how a group completion is assembled from its ranks',
and the engine's programs on two ranks.

- timing (DUR-14, DUR-15, ACCT-9, OPEN-37): the group completion holds every rank's
  device interval, so a rank reporting a longer interval sets the estimate, a rank
  whose interval is missing (zero) neither lowers it nor, alone, makes it fresh, and
  the readiness correction applies after the ranks are aggregated;
- outputs: rank zero's, plus the peers' under ``PEER_OUTPUTS_KEY`` (ACC-16 is then the
  validator's: ``tests/actors/test_validator_ranks.py``);
- rank 0 combines every rank's outcome: a peer's fault fails the group launch naming
  the peer and stops the group, a fault in bind fails the launch alone;
- on real device processes: prefill and decode frames on two ranks (queued back to
  back) give the tokens of one, with one positive interval per rank.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from gpu.backends.cpu_process import DeviceLost
from gpu.backends.protocol import Completion, ProgramFault
from gpu.backends.rank_worker import RankFault, combine, combined_outcome
from gpu.backends.tensor_parallel import stops_group
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


def fault(stage: str, cause: BaseException) -> bytes:
    return pickle.dumps(("fault", 0, DECODE, stage, cause))


def done(completion: Completion) -> bytes:
    return pickle.dumps(("done", 0, completion))


def test_a_peers_fault_fails_the_group_launch_naming_the_rank() -> None:
    """Rank 0 answers for the group: a peer's fault fails the launch, naming the peer,
    and stops the group (it happened past bind)."""
    kind, _, shape, stage, cause = pickle.loads(combined_outcome(
        [done(rank(5)), fault("execute", RuntimeError("Connection closed by peer"))]))
    assert (kind, shape, stage) == ("fault", DECODE, "execute")
    assert isinstance(cause, RankFault) and "rank 1: RuntimeError: Connection" in str(cause)
    assert stops_group(ProgramFault(DECODE, stage, cause))
    assert stops_group(ProgramFault(DECODE, "device", DeviceLost("killed by SIGKILL")))
    kind, _, _, _, cause = pickle.loads(combined_outcome(
        [fault("execute", ValueError("rank 0's")), fault("execute", ValueError("rank 1's"))]))
    assert str(cause) == "rank 0's"  # rank zero's own fault first


def test_a_completed_launch_combines_every_rank() -> None:
    kind, _, completion = pickle.loads(combined_outcome([done(rank(5 * MS, result="zero")),
                                                         done(rank(7 * MS, result="one"))]))
    assert kind == "done" and completion.outputs[RESULT_KEY] == "zero"
    assert completion.timing.device_intervals_ns == (5 * MS, 7 * MS)


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
    the launch fails with rank zero's fault and the group keeps serving."""
    bind = ValueError("row 9 out of range")
    kind, _, _, stage, cause = pickle.loads(combined_outcome(
        [fault("bind", bind), fault("bind", bind)]))
    assert (kind, stage) == ("fault", "bind") and isinstance(cause, ValueError)
    assert not stops_group(ProgramFault(DECODE, stage, cause))
