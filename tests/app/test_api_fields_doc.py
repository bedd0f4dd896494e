"""``docs/api.md``'s field table says exactly what ``app/field_table.py`` decides: every
field of the completions and chat tables has one row, on the right routes, with the
same status and the same neutral value of a refused field."""

from __future__ import annotations

import json
import re
from pathlib import Path

from app.field_table import CHAT_FIELDS, COMPLETION_FIELDS, FieldRule, Support

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ROUTES = {"completions": COMPLETION_FIELDS, "chat": CHAT_FIELDS}


def _documented() -> dict[str, dict[str, str]]:
    """field -> route -> status cell (e.g. ``refused [0]``)."""
    text = API_DOC.read_text()
    section = text[text.index("### Fields"):text.index("### Choices")]
    rows: dict[str, dict[str, str]] = {}
    for line in section.splitlines():
        match = re.match(r"\| `([a-z_]+)` \| (\w+) \| ([^|]+) \|", line)
        if match is None:
            continue
        name, routes, status = match.group(1), match.group(2), match.group(3).strip()
        assert name not in rows, f"two rows for {name}"
        covered = list(ROUTES) if routes == "both" else [routes]
        per_route = dict(part.split(": ", 1) for part in status.split("; ")) \
            if ": " in status else dict.fromkeys(covered, status)
        assert sorted(per_route) == sorted(covered), line
        rows[name] = per_route
    return rows


def _status(rule: FieldRule) -> str:
    if rule.support is not Support.REFUSED or not rule.neutral:
        return rule.support.value
    return f"refused [{json.dumps(rule.neutral[0])}]"


def test_every_field_has_one_row_with_its_status() -> None:
    documented = _documented()
    for route, table in ROUTES.items():
        for name, rule in table.items():
            assert documented.get(name, {}).get(route) == _status(rule), (route, name)
    for name, per_route in documented.items():
        for route in per_route:
            assert name in ROUTES[route], (route, name)
