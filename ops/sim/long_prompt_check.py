"""The long-prompt check of ``flare sim-capacity``.

At one rate of the periodic-long-prompt scenario (``long-prompts``, the simulator's
``interference``), each configuration's worst long-prompt TTFT is compared with that
prompt's pure prefill time, and its chat ITL p99 with the lowest chat ITL p99 of any
``sarathi`` budget. A configuration passes when every long prompt's TTFT is within
``ttft_factor`` (4) of the pure prefill time and its chat ITL p99 within ``itl_factor``
(1.1) of that sarathi reference.

The pure prefill time is the prompt alone on the device: the fastest way to cover its
tokens with one prefill shape of the catalog, ``min over C of ceil(L / C) * T(C)``.

Two more figures say what the verdict alone cannot:

- **chat ITL p99 without the long prompts**: the same configuration on the same chat
  traffic with no long prompt, and the ratio of the two p99s, which is what the long
  prompts themselves cost the chat streams;
- **against the best fixed-depth speculation** (speculating configurations only): chat
  ITL p99 over the lowest of any ``fixed-spec-K`` run. ITL is the gap between streamed
  chunks (as ``vllm bench serve`` counts it), and a speculative round, which delivers
  several tokens in one chunk, is a longer frame than a plain decode, so a speculating
  configuration's chunk gaps are longer than sarathi's even without long prompts. The
  ``fixed-spec-K`` baselines chunk prompts as sarathi does and speculate every decode: the
  reference on the same speculative load.

Chat ITL p99 **per token** is the other convention: a chunk gap that delivers ``n``
tokens counts as ``n`` intervals of gap / ``n`` (``ops.sim.runs.per_token_gaps_s``), with
its ratio to the lowest per-token figure of any ``sarathi`` budget. Every chunk of a
configuration that does not speculate carries one token, so there the two conventions
give the same figure; the verdict stays on the per-chunk one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ops.sim.costs import CostTable, pure_prefill_ns
from ops.sim.workloads import LONG_CLIENT
from policy.baselines import speculative_policy
from policy.baselines.fixed_spec import fixed_spec_depth
from policy.descriptors import GraphShape

NS_PER_MS = 1_000_000
TTFT_FACTOR = 4.0
ITL_FACTOR = 1.1


def pure_prefill_ms(prompt_tokens: int, catalog: Iterable[GraphShape],
                    costs: CostTable) -> float:
    """The fastest single-shape prefill of ``prompt_tokens`` alone, in ms."""
    return pure_prefill_ns(prompt_tokens, catalog, costs) / NS_PER_MS


def _chat_itl_p99(run: Mapping[str, Any], key: str = "itl_s") -> float | None:
    for client, latency in run["per_client"].items():
        if client != LONG_CLIENT:
            p99 = latency.get(key, {}).get("p99")
            return None if p99 is None else float(p99)
    return None


def _best_itl(runs: Sequence[Mapping[str, Any]], policies: Callable[[str], bool],
              key: str = "itl_s") -> float | None:
    return min((v for r in runs if policies(r["policy"])
                and (v := _chat_itl_p99(r, key)) is not None), default=None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def long_prompt_rows(runs: Sequence[Mapping[str, Any]], prefill_ms: float, *,
                     alone: Mapping[str, Mapping[str, Any]] | None = None,
                     ttft_factor: float = TTFT_FACTOR,
                     itl_factor: float = ITL_FACTOR) -> list[dict[str, Any]]:
    """One row per run (``simulate_rate`` metrics with ``configuration`` and ``policy``):
    worst long-prompt TTFT, its ratio to ``prefill_ms``, chat ITL p99 and its ratio to
    the best sarathi budget's, and whether both targets hold. ``alone`` (configuration
    label -> its run on the chat traffic without long prompts) adds that run's chat ITL
    p99 and the ratio; speculating runs also get their ratio to the best ``fixed-spec-K``
    run's chat ITL p99. The per-token chat ITL p99 (``itl_token_s``) and its ratio to the
    best sarathi budget's per-token figure come last."""
    reference = _best_itl(runs, lambda policy: policy == "sarathi")
    reference_token = _best_itl(runs, lambda policy: policy == "sarathi", "itl_token_s")
    fixed_spec = _best_itl(runs, lambda policy: fixed_spec_depth(policy) is not None)
    rows = []
    for r in runs:
        long = r["per_client"].get(LONG_CLIENT)
        worst = long["ttft_s"]["max"] if long else None
        itl = _chat_itl_p99(r)
        itl_token = _chat_itl_p99(r, "itl_token_s")
        ttft_ratio = None if worst is None else worst * 1e3 / prefill_ms
        itl_ratio = _ratio(itl, reference)
        quiet = alone.get(r["configuration"]) if alone else None
        itl_alone = None if quiet is None else _chat_itl_p99(quiet)
        every_long = bool(long) and long["requests"] == r["sent_by_client"].get(LONG_CLIENT)
        rows.append({
            "configuration": r["configuration"], "rate": r["rate"],
            "long_ttft_max_ms": None if worst is None else worst * 1e3,
            "ttft_over_prefill": ttft_ratio,
            "chat_itl_p99_ms": None if itl is None else itl * 1e3,
            "itl_over_best_sarathi": itl_ratio,
            "chat_itl_p99_alone_ms": None if itl_alone is None else itl_alone * 1e3,
            "itl_over_alone": _ratio(itl, itl_alone),
            "itl_over_best_fixed_spec": _ratio(itl, fixed_spec)
            if speculative_policy(r["policy"]) else None,
            "chat_itl_token_p99_ms": _ms(itl_token),
            "itl_token_over_best_sarathi": _ratio(itl_token, reference_token),
            "passes": (every_long and ttft_ratio is not None and ttft_ratio <= ttft_factor
                       and itl_ratio is not None and itl_ratio <= itl_factor),
        })
    return rows


def long_prompt_table(rows: Sequence[Mapping[str, Any]], prefill_ms: float) -> str:
    """The Markdown table of ``long_prompt_rows``."""
    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    def times(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    rate = rows[0]["rate"] if rows else 0.0
    lines = [f"Long prompts at {rate:g}/s (pure prefill {prefill_ms:.0f} ms; targets: "
             f"TTFT <= {TTFT_FACTOR:g}x it, chat ITL p99 <= {ITL_FACTOR:g}x the best "
             "sarathi budget's):", "",
             "| configuration | worst long TTFT (ms) | / prefill | chat ITL p99 (ms) "
             "| / best sarathi | both | without long prompts (ms) | long prompts' cost "
             "| / best fixed-spec | chat ITL p99 per token (ms) | / best sarathi per token |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['configuration']} | {fmt(r['long_ttft_max_ms'], '.0f')} "
                     f"| {fmt(r['ttft_over_prefill'], '.2f')}x "
                     f"| {fmt(r['chat_itl_p99_ms'], '.1f')} "
                     f"| {fmt(r['itl_over_best_sarathi'], '.2f')}x "
                     f"| {'yes' if r['passes'] else 'no'} "
                     f"| {fmt(r.get('chat_itl_p99_alone_ms'), '.1f')} "
                     f"| {times(r.get('itl_over_alone'))} "
                     f"| {times(r.get('itl_over_best_fixed_spec'))} "
                     f"| {fmt(r.get('chat_itl_token_p99_ms'), '.1f')} "
                     f"| {times(r.get('itl_token_over_best_sarathi'))} |")
    return "\n".join(lines) + "\n"
