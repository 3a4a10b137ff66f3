"""The JSON row every ``deltacast bench`` prints: one object per line with ``--json``.

Required keys, in this order (``null`` where a key does not apply)::

    scenario   str          workload name
    batch      int | null   scheduled requests per step
    workers    int | null   worker replicas decoding each message
    format     str          wire format ("deltacast", "pickle_v1", "pickle", ...)
    bytes      int | null   median bytes on the wire per step
    encode_us  float | null median engine-side microseconds per step
    decode_us  float | null median worker-side microseconds per step
    total_us   float | null encode_us + decode_us

Benches may add extra keys after these (e.g. ``baseline``, ``steps``,
``bytes_max``); readers must ignore keys they do not know.
"""

from __future__ import annotations

import json
import math
from typing import Any

Row = dict[str, Any]

ROW_KEYS: tuple[str, ...] = ("scenario", "batch", "workers", "format", "bytes", "encode_us",
                             "decode_us", "total_us")
_TYPES: dict[str, tuple[type, ...]] = {
    "scenario": (str,), "batch": (int,), "workers": (int,), "format": (str,), "bytes": (int,),
    "encode_us": (float, int), "decode_us": (float, int), "total_us": (float, int),
}
_REQUIRED = ("scenario", "format")  # never null


def make_row(scenario: str, batch: int | None, workers: int | None, format: str,
             bytes: int | None, encode_us: float | None, decode_us: float | None,
             **extra: Any) -> Row:
    """A row with ``total_us = encode_us + decode_us`` (null if either is null)."""
    total = None if encode_us is None or decode_us is None else encode_us + decode_us
    row: Row = {"scenario": scenario, "batch": batch, "workers": workers, "format": format,
                "bytes": bytes, "encode_us": _round(encode_us), "decode_us": _round(decode_us),
                "total_us": _round(total)}
    row.update(extra)
    return row


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 2)


def row_problems(row: Row) -> list[str]:
    """Every way ``row`` breaks the schema (empty when it is valid)."""
    problems = [f"missing key {k!r}" for k in ROW_KEYS if k not in row]
    for key, types in _TYPES.items():
        value = row.get(key)
        if value is None:
            if key in _REQUIRED and key in row:
                problems.append(f"{key} must not be null")
        elif isinstance(value, bool) or not isinstance(value, types):
            problems.append(f"{key} has type {type(value).__name__}")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key} is not finite")
    enc, dec, total = row.get("encode_us"), row.get("decode_us"), row.get("total_us")
    if not problems and None not in (enc, dec, total) and abs(enc + dec - total) > 0.02:  # type: ignore[operator]
        problems.append("total_us differs from encode_us + decode_us")
    return problems


def dumps(row: Row) -> str:
    """One JSON line (no trailing newline)."""
    return json.dumps(row, separators=(", ", ": "))
