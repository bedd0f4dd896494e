"""``docs/grafana-dashboard.json`` draws only what ``/metrics`` exports: every metric name
in every panel's query is a series a served request (and one refused request) leaves
on ``/metrics``, and every flare query selects the dashboard's ``model_name``."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from ops.testing import FlareServer

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
METRIC_NAME = re.compile(r"\b(?:flare|process)_[a-z0-9_]+\b")


def queries(node: Any) -> Iterator[str]:
    """Every ``expr`` of the dashboard, however deep its panels are nested."""
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"]
        for child in node.values():
            yield from queries(child)
    elif isinstance(node, list):
        for child in node:
            yield from queries(child)


def test_every_panel_queries_flare_metrics_of_the_selected_model() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(queries(dashboard["panels"]))
    assert len(exprs) >= 16
    for expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, expr
        for name in names:
            if name.startswith("flare_"):
                assert re.search(re.escape(name) + r'\{model_name="\$model_name"\}', expr), expr
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


async def test_every_metric_the_dashboard_names_is_exported(flare_server: FlareServer) -> None:
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=flare_server.url, timeout=30) as client:
            ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            refused = await client.post("/v1/completions", json={"prompt": "x",
                                                                  "max_tokens": "two"})
            text = (await client.get("/metrics")).text
    assert (ok.status_code, refused.status_code) == (200, 400)
    exported = {sample.name for family in text_string_to_metric_families(text)
                for sample in family.samples}
    named = {name for expr in queries(json.loads(DASHBOARD.read_text()))
             for name in METRIC_NAME.findall(expr)}
    assert named - exported == set()
