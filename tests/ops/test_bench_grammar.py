"""``flare bench grammar`` on the embedded model's vocabulary: the shipped library
steps through the whole benchmark document (every token allowed by its masks) and a
library that is not installed is reported as skipped, not as a failure."""

from __future__ import annotations

import json

import pytest

from ops import cli


def test_bench_grammar_times_llguidance_and_skips_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "grammar", "--repeat", "1",
                     "--libraries", "llguidance,no_such_grammar_library"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    header, shipped, missing = rows
    assert header["document_tokens"] > 10
    assert shipped["library"] == "llguidance" and shipped["mask_us_p50"] > 0
    assert shipped["imports_heavy_modules"] == []
    assert missing["library"] == "no_such_grammar_library" and "skipped" in missing


@pytest.mark.slow
def test_bench_structured_prints_both_rates_and_their_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``flare bench structured`` prints, per stream count, the unconstrained and the
    JSON-schema rates, their ratio and where the grammars were held."""
    assert cli.main(["bench", "structured", "--streams", "1", "--rounds", "1",
                     "--requests-per-stream", "1", "--max-tokens", "8"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["streams"] == 1 and row["grammars"] == "resident"
    assert row["free_tokens_per_s"] > 0 and row["schema_tokens_per_s"] > 0
    assert row["ratio"] == pytest.approx(row["schema_tokens_per_s"] / row["free_tokens_per_s"],
                                         abs=0.01)
