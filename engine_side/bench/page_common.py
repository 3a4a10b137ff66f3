"""What every converter of a benchmark's output into a figures table shares
(:mod:`engine_side.bench.page_tables` and the ``page_*`` modules beside it)."""

from __future__ import annotations

from typing import Any

Fields = dict[str, Any]  # an envelope's fields: name, title, what, columns, rows, ...
NONE = "–"  # an empty cell (and the "slower on" column when deltacast is slower on nothing)


def target(what: str, value: Any, limit: str, met: bool | None) -> dict[str, Any]:
    """One line of a section's targets table (``met`` None: a figure reported)."""
    return {"target": what, "value": value, "limit": limit,
            "met": None if met is None else bool(met)}
