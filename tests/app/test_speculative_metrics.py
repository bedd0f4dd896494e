"""``flare_speculative_*`` metrics: complete programs, drafted and accepted
tokens and accepted per position, labelled by proposal source; absent when off."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors.public import RuntimeStatistics
from app.metrics import RuntimeCollector


def scrape(stats: RuntimeStatistics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(lambda: stats))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def stats(**speculative: object) -> RuntimeStatistics:
    return RuntimeStatistics(
        requests_running=0, requests_waiting=0, kv_pages_used=0, kv_pages_total=1,
        prefix_cache_hit_tokens=0, prompt_tokens_total=0, generation_tokens_total=0,
        executions_by_kind=(), execution_ns_by_kind=(), executions_by_graph=(),
        **speculative)  # type: ignore[arg-type]


def test_speculative_counters_by_source_and_position() -> None:
    s = scrape(stats(speculative_source="copy", speculative_frames=4,
                     speculative_drafted_tokens=9, speculative_accepted_tokens=5,
                     speculative_accepted_by_position=(3, 2)))
    src = (("source", "copy"),)
    assert s[("flare_speculative_programs_total", src)] == 4
    assert s[("flare_speculative_drafted_tokens_total", src)] == 9
    assert s[("flare_speculative_accepted_tokens_total", src)] == 5
    assert s[("flare_speculative_accepted_by_position_total",
              (("position", "1"), ("source", "copy")))] == 2


def test_counterfactual_copy_rounds_are_counted() -> None:
    s = scrape(stats(speculative_source="copy", counterfactual_rounds=7,
                     counterfactual_drafted_tokens=20, counterfactual_accepted_tokens=11))
    src = (("source", "copy"),)
    assert s[("flare_speculative_counterfactual_rounds_total", src)] == 7
    assert s[("flare_speculative_counterfactual_drafted_tokens_total", src)] == 20
    assert s[("flare_speculative_counterfactual_accepted_tokens_total", src)] == 11


def test_no_speculative_metrics_when_off() -> None:
    assert not any(name.startswith("flare_speculative") for name, _ in scrape(stats()))
