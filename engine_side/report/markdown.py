"""report.md: the headline table, per-workload details, per-field splits, plots."""

from __future__ import annotations

from typing import Any

from engine_side.report.summary import faster_or_slower, smaller_or_larger


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return lines


def _formats(w: dict[str, Any]) -> list[str]:
    rows = []
    for fmt, f in w["formats"].items():
        rows.append({"format": fmt, "total bytes": f["total_bytes"],
                     "bytes p50": round(f["bytes"]["p50"]), "bytes p99": round(f["bytes"]["p99"]),
                     "encode µs p50": round(f["encode_us"]["p50"], 1),
                     "decode µs p50": round(f["decode_us"]["p50"], 1),
                     "× deltacast bytes": round(f["bytes_ratio_vs_deltacast"], 1),
                     "× deltacast µs": round(f["us_ratio_vs_deltacast"], 2)})
    return _table(rows)


def _comparison(w: dict[str, Any]) -> list[str]:
    """One sentence per workload: deltacast against each baseline, in words (slower says so)."""
    f, ours = w["formats"], w["formats"]["deltacast"]
    parts = [f"{smaller_or_larger(ours['total_bytes'], f[fmt]['total_bytes'])} and "
             f"{faster_or_slower(ours['total_us']['p50'], f[fmt]['total_us']['p50'])} than {fmt}"
             for fmt in f if fmt != "deltacast"]
    return [f"deltacast here (total bytes; encode + decode µs p50): {'; '.join(parts)}."]


def _slower_note(report: dict[str, Any]) -> list[str]:
    """Under the headline: the workloads where deltacast takes longer than pickle_v1."""
    rows = [h for h in report["headline"]
            if h.get("deltacast time vs pickle_v1", "").endswith("slower")]
    if not rows:
        return ["deltacast is faster than pickle_v1 (µs p50 per step) on every workload.", ""]
    slower = [f"{h['workload']} ({h['deltacast time vs pickle_v1']})" for h in rows]
    line = (f"**Slower on time:** deltacast takes longer per step than pickle_v1 (encode + "
            f"decode µs p50) on {len(rows)} of {len(report['headline'])} workloads: "
            f"{', '.join(slower)}.")
    ratios = [h["pickle_v1 / deltacast"] for h in rows]
    if min(ratios) > 1:
        line += (f" On those it sends {min(ratios):g}–{max(ratios):g}× fewer bytes than "
                 "pickle_v1: which matters more depends on the link.")
    return [line, ""]


def _fields(w: dict[str, Any]) -> list[str]:
    ours = {k: round(v, 1) for k, v in w["deltacast_fields"].items() if v}
    theirs = {k: round(v, 1) for k, v in w["pickle_v1_fields_estimate"].items() if v}
    return [f"- deltacast mean bytes/step by field: {ours}",
            f"- pickle_v1 mean bytes/step by part (estimate, pickle memoises): {theirs}"]


def render(report: dict[str, Any]) -> str:
    lines = ["# deltacast wire-size report", "",
             f"Command: `{report['command']}` ({report['seconds']} s).", "",
             "Mean bytes per step of each format, side by side on the same steps "
             "(pickle_v1 = vLLM v1 SchedulerOutput RPC tuple, pickle = full request, "
             "msgspec_full = full request without deltas):", ""]
    lines += _table(report["headline"]) + [""] + _slower_note(report)
    lines += ["![bytes per step](bytes_per_step.png)", "",
              "![cumulative bytes](cumulative_bytes.png)", "",
              "![per-field breakdown](breakdown.png)", "",
              "![µs per step on each workload](us_per_workload.png)", ""]
    if "us_vs_batch" in report["figures"]:
        lines += ["![µs per step vs batch](us_vs_batch.png)", ""]
    for w in report["workloads"]:
        lines += [f"## {w['workload']} (batch {w['batch']})", ""]
        lines += [f"pickle_v1 baseline: {w['labels'].get('pickle_v1', '')}", ""]
        lines += _formats(w) + [""] + _comparison(w) + [""] + _fields(w) + [""]
    return "\n".join(lines) + "\n"
