"""flare's first-token urgency extension (``prompt_age_price``, the ``first-token``
preset): a prompt's token price grows with the time it has waited since the request
arrived, a wait for a running slot before admission included.

An opt-in departure from SEL-5 (``docs/scheduling-utility.md``, *First-token
urgency*); the seed's presets keep the seed's price, which these tests also pin."""

from __future__ import annotations

from dataclasses import replace

from selection_setup import make_prompt, plan_beside_decoders
from synthetic_catalog import MS, decode, measured_scheduler, prefill

from policy import GraphKind, Scheduler
from policy.baselines import make_policy
from policy.config import PolicyConfig, policy_preset
from policy.prompt_prices import first_token_prices


def test_price_is_the_seed_price_plus_the_age_term() -> None:
    seed = PolicyConfig()
    assert first_token_prices([4.0, 2.0], [0.0, 300.0], seed) == [1.0 + 16 / 4, 1.0 + 16 / 2]
    urgent = replace(seed, prompt_age_price=0.5)
    assert first_token_prices([4.0, 2.0], [0.0, 300.0], urgent) == [5.0, 9.0 + 150.0]


def test_seed_presets_keep_the_seed_price_and_first_token_departs() -> None:
    for name in ("balanced", "throughput"):
        assert policy_preset(name).prompt_age_price == 0.0
    ext = policy_preset("first-token")
    assert ext == replace(policy_preset("balanced"), prompt_age_price=0.03,
                          terminal_value=10_000.0)
    policy = make_policy("first-token")
    assert isinstance(policy, Scheduler) and policy.config == ext


def _winner_after_wait(config: PolicyConfig, waited_ms: float) -> GraphKind:
    """Four decoders against one prompt that has just been served (high token rate) and
    has waited ``waited_ms`` since admission; the decoders' output is fresh."""
    s = measured_scheduler((decode(4), prefill(64)), config)
    make_prompt(s, prompt_len=64, token_rate=100.0)
    s.advance_to(s.now_ns + round(waited_ms * MS))
    return plan_beside_decoders(s, 4, age_ms=0.0).kind


def test_a_waiting_prompt_overtakes_decoders_only_with_urgency() -> None:
    seed = PolicyConfig()
    urgent = replace(seed, prompt_age_price=1.0)
    # The seed's price does not age: the decoders win however long the prompt waited.
    assert _winner_after_wait(seed, 0.0) is GraphKind.DECODE
    assert _winner_after_wait(seed, 1000.0) is GraphKind.DECODE
    # With urgency a fresh prompt still loses, a prompt waiting for a second wins.
    assert _winner_after_wait(urgent, 0.0) is GraphKind.DECODE
    assert _winner_after_wait(urgent, 1000.0) is GraphKind.PREFILL


def _winner_after_queueing(config: PolicyConfig, queued_ms: float) -> GraphKind:
    """As ``_winner_after_wait``, for a prompt admitted just now that arrived
    ``queued_ms`` earlier and waited for a running slot outside the scheduler."""
    s = measured_scheduler((decode(4), prefill(64)), config)
    s.advance_to(s.now_ns + round(1000 * MS))
    h = s.admit(prompt_len=64, max_output_tokens=16,
                arrived_ns=s.now_ns - round(queued_ms * MS))
    s.request(h).history.token_rate = 100.0
    return plan_beside_decoders(s, 4, age_ms=0.0).kind


def test_the_wait_for_a_running_slot_counts_toward_the_prompt_age() -> None:
    urgent = replace(PolicyConfig(), prompt_age_price=1.0)
    # Admitted now, it arrived a second ago: as urgent as a prompt resident that long.
    assert _winner_after_queueing(urgent, 1000.0) is GraphKind.PREFILL
    assert _winner_after_queueing(urgent, 0.0) is GraphKind.DECODE
    # The seed's price has no age: arrival changes nothing.
    assert _winner_after_queueing(PolicyConfig(), 1000.0) is GraphKind.DECODE


def test_an_arrival_after_admission_counts_from_admission() -> None:
    s = measured_scheduler((decode(4), prefill(64)), PolicyConfig())
    h = s.admit(prompt_len=64, max_output_tokens=16, arrived_ns=s.now_ns + 5 * MS)
    assert s.request(h).arrived_ns == s.now_ns
    assert s.request(s.admit(prompt_len=64, max_output_tokens=16)).arrived_ns is None
