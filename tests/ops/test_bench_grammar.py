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
