"""Decision equivalence: the recorded seeded runs still plan bit-identically.

``data/decision_trace.json`` was generated from the scheduler before the ``plan()`` /
``complete()`` performance work (docs/benchmarks-plan.md). Every optimisation
must leave each decision unchanged: same shape, reason, timing, flags and lanes, every
float bit for bit (QUEUE-5: a plan freezes exactly these), and the same final request
state (service histories, counters: ACCT-7..11). The runs and what they cover are
described in ``decision_trace.py``.
"""

from __future__ import annotations

import json

import pytest
from decision_trace import FIXTURE, SCENARIOS, Scenario, run


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda sc: sc.name)
def test_queue_5_recorded_runs_plan_identically(scenario: Scenario) -> None:
    expected = json.loads(FIXTURE.read_text())[scenario.name]
    got = run(scenario)
    for i, (want, have) in enumerate(zip(expected["digests"], got["digests"], strict=True)):
        assert want == have, (
            f"{scenario.name}: plan {i} differs (recorded shape/lanes "
            f"{expected['summary'][i]}, now {got['summary'][i]})")
    assert got["state"] == expected["state"], f"{scenario.name}: final state differs"
