"""``--scheduler-policy fixed-spec-K`` through the whole runtime on the real CPU backend
with a tiny random Llama pair: every decode step is a complete speculative round of
width K + 1 (the fixed-spec-k baseline), its rounds complete through the planner
like any generation frame, and greedy output equals greedy output without speculation,
token for token; every page and state row returns. Covers SPEC-5, SPEC-19, QUEUE-3."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.config import ConfigError
from policy.baselines import FixedSpecPolicy
from tests.actors.test_runtime_cpu import config_for
from tests.actors.test_runtime_speculative import _serve
from tests.actors.test_runtime_speculative import plain_outputs as plain_outputs

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("policy", "source", "perfect"), [
    ("fixed-spec-2", "draft", True), ("fixed-spec-1", "copy", False)])
async def test_fixed_spec_rounds_keep_greedy_output(
        tiny_llama: Path, plain_outputs: list[list[int]], policy: str, source: str,
        perfect: bool) -> None:
    """The target's own weights as the draft accept every draft: multi-token bursts."""
    depth = int(policy.rsplit("-", 1)[1])
    config = config_for(tiny_llama, speculation="adaptive", draft_source=source,
                        draft_model_dir=tiny_llama if source == "draft" else None,
                        draft_depth=3, scheduler_policy=policy)
    served = await _serve(config)
    results, resources, graphs = served.results, served.resources, served.graphs
    assert isinstance(served.scheduler, FixedSpecPolicy)
    assert served.scheduler.depth == depth
    assert [tokens for tokens, _ in results] == plain_outputs
    assert resources.rows_free == resources.rows_total
    decoding = [label for label in graphs if not label.startswith("prefill")]
    assert decoding and all(label.startswith("speculative[")
                            and f",D={depth},W={depth + 1}," in label
                            for label in decoding), graphs
    if perfect:
        assert any(deltas < len(tokens) for tokens, deltas in results)


def test_fixed_spec_needs_a_deep_enough_speculative_load(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="needs a speculative load"):
        config_for(tiny_llama, scheduler_policy="fixed-spec-2").validate()
    with pytest.raises(ConfigError, match="--draft-depth 3 or more"):
        config_for(tiny_llama, speculation="adaptive", draft_source="copy", draft_depth=2,
                   scheduler_policy="fixed-spec-3").validate()
