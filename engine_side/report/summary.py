"""Numbers of a report: per-format totals, percentiles, ratios and field splits (JSON-ready)."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine_side.report.accounting import CATEGORIES, PICKLE_CATEGORIES
from engine_side.report.replay import FORMATS, Replay


def _stats(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max())}


def format_summary(rep: Replay, fmt: str) -> dict[str, Any]:
    steps = rep.steps[fmt]
    return {
        "steps": len(steps),
        "total_bytes": int(sum(s.bytes for s in steps)),
        "bytes": _stats([s.bytes for s in steps]),
        "encode_us": _stats([s.encode_us for s in steps]),
        "decode_us": _stats([s.decode_us for s in steps]),
        "total_us": _stats([s.encode_us + s.decode_us for s in steps]),
    }


def _mean_split(rep: Replay, fmt: str, categories: tuple[str, ...]) -> dict[str, float]:
    steps = [s for s in rep.steps[fmt] if s.breakdown is not None]
    return {c: float(np.mean([s.breakdown[c] for s in steps])) for c in categories}  # type: ignore[index]


def workload_summary(rep: Replay) -> dict[str, Any]:
    formats = {fmt: format_summary(rep, fmt) for fmt in FORMATS}
    ours = formats["deltacast"]
    for entry in formats.values():
        entry["bytes_ratio_vs_deltacast"] = entry["total_bytes"] / max(1, ours["total_bytes"])
        entry["us_ratio_vs_deltacast"] = entry["total_us"]["p50"] / max(1e-9,
                                                                        ours["total_us"]["p50"])
    return {
        "workload": rep.name, "batch": rep.batch, "labels": rep.labels, "formats": formats,
        "deltacast_fields": _mean_split(rep, "deltacast", CATEGORIES),
        "pickle_v1_fields_estimate": _mean_split(rep, "pickle_v1", PICKLE_CATEGORIES),
        "bytes_per_step": {fmt: [s.bytes for s in rep.steps[fmt]] for fmt in FORMATS},
    }


def headline(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload: mean bytes/step of each format and the pickle_v1 ratio."""
    rows = []
    for s in summaries:
        f = s["formats"]
        rows.append({"workload": s["workload"], "batch": s["batch"],
                     **{fmt: round(f[fmt]["bytes"]["mean"]) for fmt in FORMATS},
                     "pickle_v1 / deltacast": round(f["pickle_v1"]["bytes_ratio_vs_deltacast"], 1),
                     "deltacast µs p50": round(f["deltacast"]["total_us"]["p50"], 1),
                     "pickle_v1 µs p50": round(f["pickle_v1"]["total_us"]["p50"], 1),
                     "deltacast time vs pickle_v1": faster_or_slower(
                         f["deltacast"]["total_us"]["p50"], f["pickle_v1"]["total_us"]["p50"])})
    return rows


def faster_or_slower(ours: float, theirs: float) -> str:
    """'4.6× slower' or '2.1× faster': our time against theirs, in words."""
    if ours <= 0 or theirs <= 0:
        return "n/a"
    return f"{ours / theirs:.2g}× slower" if ours > theirs else f"{theirs / ours:.2g}× faster"


def smaller_or_larger(ours: float, theirs: float) -> str:
    """'12× smaller' or '1.5× larger': our bytes against theirs, in words."""
    if ours <= 0 or theirs <= 0:
        return "n/a"
    return f"{ours / theirs:.2g}× larger" if ours > theirs else f"{theirs / ours:.2g}× smaller"
