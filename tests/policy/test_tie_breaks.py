"""DUR-24's tie-break keys, one exact tie per key, through the production ``Scheduler``.

Every scenario uses prices that are small integers (no fairness terms, no age price), so
two candidates have bit-identical value rates: ``value / ms`` with values and durations
chosen to divide exactly. In each test the earlier keys tie, the key under test decides,
and the later keys (and the table order, which lists decode steps before prefill steps)
prefer the loser, so dropping, reversing or permuting a key fails one of these tests.
"""

from __future__ import annotations

from collections.abc import Mapping

from decoding import decoding
from synthetic_catalog import MS, decode, mixed, prefill

from policy import GraphKind, GraphShape, RequestHandle, Scheduler
from policy.config import PolicyConfig


def tie_scheduler(durations_ms: Mapping[GraphShape, float], *,
                  output_token_value: float, token_fairness: float = 0.0) -> Scheduler:
    """Without fairness, decode rows are worth ``output_token_value`` each and prompt
    tokens 1 each."""
    config = PolicyConfig(token_fairness=token_fairness, delivery_fairness=0.0, decode_age_price=0.0,
                          output_token_value=output_token_value)
    s = Scheduler(config, tuple(durations_ms))
    for shape, ms in durations_ms.items():
        s.estimates.observe(shape, round(ms * MS), 1)
    s.advance_to(1_000 * MS)
    return s


def decoder(s: Scheduler, *, served_ns: int) -> RequestHandle:
    h = decoding(s, prompt_len=8, max_output_tokens=1000, visible_ago_ns=0)
    s.request(h).last_served_ns = served_ns
    return h


def prompt(s: Scheduler, *, prompt_len: int, served_ns: int) -> RequestHandle:
    h = s.admit(prompt_len=prompt_len, max_output_tokens=16)
    s.request(h).last_served_ns = served_ns
    return h


def winner(s: Scheduler) -> tuple[GraphKind, int, frozenset[RequestHandle]]:
    plan = s.plan()
    assert plan is not None
    return plan.shape.kind, plan.shape.batch_capacity, frozenset(plan.handles())


def test_dur_24_shorter_known_time_first() -> None:
    """Covers DUR-24, OPEN-19: prefill(64) at 1 ms (64 / 1) ties decode(2) at 2 ms
    (2 x 64 / 2); the shorter one wins although the decode step serves more requests,
    less recently, and comes first in table order."""
    s = tie_scheduler({prefill(64): 1.0, decode(2): 2.0}, output_token_value=64.0)
    p = prompt(s, prompt_len=1000, served_ns=900 * MS)
    decoder(s, served_ns=10 * MS)
    decoder(s, served_ns=20 * MS)
    assert winner(s) == (GraphKind.PREFILL, 1, frozenset({p}))


def test_dur_24_more_served_requests_second() -> None:
    """Covers DUR-24, OPEN-19: at equal time, decode(4) with two rows (2 x 32) ties
    prefill(64) (64); serving two requests wins although the prompt was served less
    recently and the decode step pads two rows."""
    s = tie_scheduler({prefill(64): 1.0, decode(4): 1.0}, output_token_value=32.0)
    prompt(s, prompt_len=1000, served_ns=1 * MS)
    a = decoder(s, served_ns=500 * MS)
    b = decoder(s, served_ns=600 * MS)
    assert winner(s) == (GraphKind.DECODE, 4, frozenset({a, b}))


def test_dur_24_less_recently_served_third() -> None:
    """Covers DUR-24, OPEN-19: equal time, one request each; the less recently served
    request wins, whichever family it is in (so neither table order nor padding, which
    prefers the unpadded prefill, decides)."""
    s = tie_scheduler({prefill(64): 1.0, decode(2): 1.0}, output_token_value=64.0)
    prompt(s, prompt_len=1000, served_ns=800 * MS)
    d = decoder(s, served_ns=100 * MS)
    assert winner(s) == (GraphKind.DECODE, 2, frozenset({d}))

    s = tie_scheduler({prefill(64): 1.0, decode(1): 1.0}, output_token_value=64.0)
    p = prompt(s, prompt_len=1000, served_ns=100 * MS)
    decoder(s, served_ns=800 * MS)
    assert winner(s) == (GraphKind.PREFILL, 1, frozenset({p}))


def test_dur_24_smaller_padding_fourth() -> None:
    """Covers DUR-24, OPEN-19: equal time, one request each, served at the same time.
    The unpadded step wins: an unpadded prefill over a half-empty decode(2), and a full
    decode(1) over prefill(128) carrying a 64-token prompt (64 padded tokens)."""
    s = tie_scheduler({prefill(64): 1.0, decode(2): 1.0}, output_token_value=64.0)
    p = prompt(s, prompt_len=1000, served_ns=100 * MS)
    decoder(s, served_ns=100 * MS)
    assert winner(s) == (GraphKind.PREFILL, 1, frozenset({p}))

    # f = 129 and the prompt's token rate 129 price its tokens at 2 and its first output
    # at 64 + 1: 64 tokens -> 2 x 64 + 65 = 193; the decoder's rate 1 prices it 64 + 129.
    s = tie_scheduler({prefill(128): 1.0, decode(1): 1.0}, output_token_value=64.0,
                      token_fairness=129.0)
    p = prompt(s, prompt_len=64, served_ns=100 * MS)
    s.request(p).history.token_rate = 129.0
    d = decoder(s, served_ns=100 * MS)
    s.request(d).history.token_rate = 1.0
    assert winner(s) == (GraphKind.DECODE, 1, frozenset({d}))

    # Two prompts on prefill(128): the first admitted (earlier in table order) ends in
    # 64 tokens (64 + its first output 64 = 128), the other fills the step (128).
    s = tie_scheduler({prefill(128): 1.0}, output_token_value=64.0)
    prompt(s, prompt_len=64, served_ns=100 * MS)
    full = prompt(s, prompt_len=1000, served_ns=100 * MS)
    assert winner(s) == (GraphKind.PREFILL, 1, frozenset({full}))


def test_dur_24_within_a_family_the_less_recently_served_request_goes_first() -> None:
    """Covers DUR-24, OPEN-19, MIX-18: equal rows of one family tie on every step
    column; the request served longer ago is taken, not the first admitted (lower
    handle)."""
    s = tie_scheduler({prefill(64): 1.0}, output_token_value=64.0)
    prompt(s, prompt_len=1000, served_ns=500 * MS)
    older = prompt(s, prompt_len=1000, served_ns=100 * MS)
    assert winner(s) == (GraphKind.PREFILL, 1, frozenset({older}))

    s = tie_scheduler({decode(1): 1.0, decode(2): 4.0}, output_token_value=64.0)
    decoder(s, served_ns=500 * MS)
    older = decoder(s, served_ns=100 * MS)
    assert winner(s) == (GraphKind.DECODE, 1, frozenset({older}))

    # A mixed step's prompt row (MIX-18): the same choice among equal prompts.
    s = tie_scheduler({mixed(2, 64): 1.0}, output_token_value=64.0)
    d = decoder(s, served_ns=300 * MS)
    prompt(s, prompt_len=1000, served_ns=500 * MS)
    older = prompt(s, prompt_len=1000, served_ns=100 * MS)
    assert winner(s) == (GraphKind.MIXED, 2, frozenset({d, older}))
