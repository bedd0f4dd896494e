"""``flare rank``'s refusals: each says what is missing and exits with 2 before
joining anything (the rank itself: ``tests/actors/test_runtime_across_machines.py``)."""

from __future__ import annotations

import argparse

import pytest

from gpu.backends.ranks import node_ranks
from ops.rank_command import main


def args(tp: int = 2, nnodes: int = 2, node_rank: int = 1) -> argparse.Namespace:
    return argparse.Namespace(tensor_parallel_size=tp, nnodes=nnodes, node_rank=node_rank,
                              threads=None, model=None, draft_model=None)


@pytest.mark.parametrize(("environ", "namespace", "says"), [
    ({}, args(), "set MASTER_ADDR and MASTER_PORT"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, args(node_rank=0),
     "node rank 0 is the serving machine"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, args(tp=3),
     "3 ranks do not split evenly over 2 machines"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, args(node_rank=2),
     "node rank 2 is not one of 0..1"),
])
def test_refusals_name_the_problem(environ: dict[str, str], namespace: argparse.Namespace,
                                   says: str, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert main(namespace) == 2
    assert says in capsys.readouterr().err


def test_each_machine_runs_its_share_of_the_ranks() -> None:
    assert [node_ranks(4, 2, k) for k in (0, 1)] == [range(0, 2), range(2, 4)]
    assert node_ranks(2, 1, 0) == range(0, 2)
