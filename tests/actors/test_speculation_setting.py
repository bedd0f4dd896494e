"""``--speculation`` names the scheduler's speculation modes: ``off`` plus exactly the
values of ``policy.rounds.SpeculationMode``, each of which the runtime converts."""

from __future__ import annotations

from typing import get_args

from actors.config import SpeculationSetting
from policy.rounds import SpeculationMode


def test_speculation_setting_is_off_or_a_speculation_mode() -> None:
    settings = set(get_args(SpeculationSetting))
    assert settings == {"off"} | {m.value for m in SpeculationMode}
    assert {SpeculationMode(s) for s in settings - {"off"}} == set(SpeculationMode)
