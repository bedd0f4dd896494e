"""flare's ``smooth`` preset: ``first-token`` with a decoder output-age price (c,
POL-5) of 50 value/ms^2 where the seed has 0.1, while the widest decode program has a
row no resident request holds (``spare_decode_age_price``).

With the larger price SEL-48's "a smaller prefill can win near a throughput knee
because it imposes less waiting" decides more often: a mixed frame whose prompt chunk
stays below the knee (here 128 tokens, almost free) beats the larger chunk that
stretches every decoding stream's gap. Once every row is held the seed's price is back
and the larger chunk wins (``docs/scheduling-utility.md``, *Spare rows*)."""

from __future__ import annotations

from dataclasses import replace

from selection_setup import make_decoder, make_prompt, plan_beside_decoders
from synthetic_catalog import MS, decode, measured_scheduler, mixed

from policy import Scheduler
from policy.baselines import make_policy
from policy.config import PolicyConfig, policy_preset
from policy.descriptors import GraphShape

# The knee of ``flare sim --cost-model roofline-llama3-8b-h100`` at 16 rows: a
# 128-token chunk rides on the decode frame for 0.01 ms, 256 tokens add 1.29 ms.
KNEE_MS = {decode(16): 8.29, mixed(16, 128): 8.30, mixed(16, 256): 9.58}
# ``--cost-model linear`` at 16 rows: every prompt token costs the same, no knee.
LINEAR_MS = {decode(16): 8.8, mixed(16, 128): 11.1, mixed(16, 256): 13.41}


def _chunk_beside(decoders: int, config: PolicyConfig,
                  costs: dict[GraphShape, float] = KNEE_MS) -> int:
    """The prompt chunk the scheduler plans for a fresh 8192-token prompt while
    ``decoders`` streams decode (the widest decode program has 16 rows; 0: a
    decode-only frame)."""
    s = measured_scheduler(tuple(costs), config,
                           durations=lambda shape: round(costs[shape] * MS))
    make_prompt(s, prompt_len=8192, token_rate=1.0)
    return plan_beside_decoders(s, decoders, age_ms=8.0).prefill_capacity


def test_smooth_is_first_token_with_a_spare_row_decoder_age_price() -> None:
    smooth = policy_preset("smooth")
    assert smooth == replace(policy_preset("first-token"), spare_decode_age_price=50.0)
    assert policy_preset("balanced").decode_age_price == 0.1  # the seed's c (POL-5)
    policy = make_policy("smooth")
    assert isinstance(policy, Scheduler) and policy.config == smooth


def test_near_the_knee_smooth_keeps_the_chunk_that_costs_the_streams_nothing() -> None:
    """14 streams and the prompt hold 15 of the 16 rows: one is spare."""
    assert _chunk_beside(14, policy_preset("first-token")) == 256
    assert _chunk_beside(14, policy_preset("balanced")) == 256
    assert _chunk_beside(14, policy_preset("smooth")) == 128


def test_with_every_row_held_smooth_takes_the_seeds_larger_chunk() -> None:
    """15 streams and the prompt hold all 16 rows: the seed's price c decides."""
    assert _chunk_beside(15, policy_preset("smooth")) == 256
    assert _chunk_beside(15, replace(policy_preset("smooth"), decode_age_price=50.0)) == 128


def test_the_request_that_took_the_last_row_keeps_the_seeds_price_while_resident() -> None:
    """An overload episode: the request whose admission held the 16th row keeps the
    seed's c after a row is free again (the queue that filled the rows is still being
    served); once it leaves, the spare-row price is back."""
    s = measured_scheduler(tuple(KNEE_MS), policy_preset("smooth"),
                           durations=lambda shape: round(KNEE_MS[shape] * MS))
    make_prompt(s, prompt_len=8192, token_rate=1.0)
    streams = [make_decoder(s, token_rate=1.0, delivery_rate=1.0, age_ms=8.0)
               for _ in range(15)]
    assert [s.request(h).took_last_row for h in streams] == [False] * 14 + [True]

    def chunk() -> int:
        plan = s.plan()
        assert plan is not None
        return plan.shape.prefill_capacity

    s.cancel(streams[0])  # 15 of 16 rows held, as in the spare-row test above
    assert chunk() == 256
    s.cancel(streams[-1])
    assert chunk() == 128


def test_without_a_knee_smooth_plans_as_first_token() -> None:
    """Where the smallest chunk lengthens the full decode frame by more than
    ``KNEE_SLACK`` the spare-row price would only hold prompts back: the seed's c."""
    first_token = _chunk_beside(14, policy_preset("first-token"), LINEAR_MS)
    assert _chunk_beside(14, policy_preset("smooth"), LINEAR_MS) == first_token == 256
    spare_everywhere = replace(policy_preset("first-token"), decode_age_price=50.0)
    assert _chunk_beside(14, spare_everywhere, LINEAR_MS) == 0


def test_without_decoders_smooth_takes_the_larger_chunk() -> None:
    """The age price costs nothing when no stream waits (SEL-47): alone, the larger
    chunk's value rate wins as in every preset."""
    shapes = (mixed(16, 128), mixed(16, 256))
    s = measured_scheduler(shapes, policy_preset("smooth"),
                           durations=lambda shape: round(KNEE_MS[shape] * MS))
    make_prompt(s, prompt_len=8192, token_rate=1.0)
    plan = s.plan()
    assert plan is not None and plan.shape.prefill_capacity == 256
