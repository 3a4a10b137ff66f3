"""The converters of the hostile-peer benchmarks' output into figures tables (for
:mod:`engine_side.bench.page_tables`): the fuzz campaign (:mod:`engine_side.bench.fuzz`)
and the hostile peers against a real demo (:mod:`engine_side.bench.hostile`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_side.bench.page_common import Fields, target


def from_fuzz(result: dict[str, Any]) -> Fields:
    """``python -m engine_side.bench.fuzz`` → one line per target and kernels."""
    rows: Sequence[dict[str, Any]] = result["rows"]
    table = [[r["target"], r["kernels"], r["cases"], r["counted"], r["decoded"],
              r["accepted"], r["rejected"], r["untyped"], r["violations"], r["hangs"],
              ", ".join(f"{k} {v:,}" for k, v in r["errors"].items())] for r in rows]
    cov = result.get("coverage")
    bad = result["untyped"] + result["violations"] + result["hangs"] + result["crashed"]
    targets = [
        target("cases past the first byte", result["counted"], "≥ 1,000,000",
                result["counted"] >= 1_000_000),
        target("untyped exceptions", result["untyped"], "0", result["untyped"] == 0),
        target("crashes, hangs", result["crashed"] + result["hangs"], "0",
                result["crashed"] + result["hangs"] == 0),
        target("state changed by a refused case", result["violations"], "0",
                result["violations"] == 0)]
    notes = [f"{result['cases']:,} cases in {result['shards']} shards (half with the C "
             f"kernels, half with DELTACAST_PURE_PYTHON=1), {result['cpu_seconds']:,} CPU s; "
             "counted: the first frame still starts with its seed's first byte and differs "
             "from it (junk refused at the header is run but not counted).",
             "decoded: came out as a value; accepted: then applied to the state of its step "
             "(core Deltas with their digest, vLLM steps); rejected: a ProtocolError subclass."]
    if cov:
        targets.append(target("decoder branch coverage", f"{cov['branch_percent']}%",
                               "reported", None))
        weakest = sorted(cov["files"].items(), key=lambda kv: kv[1]["percent"])[:4]
        cases = cov.get("cases", "all")
        notes.append(f"Branch coverage of the decoder modules (coverage.py, {cases} cases): "
                     f"{cov['taken']:,} of {cov['branches']:,} branches "
                     f"({cov['branch_percent']}%), {cov['line_percent']}% of lines; lowest: "
                     + ", ".join(f"{f} {v['percent']}%" for f, v in weakest) + ".")
    if result["violations"]:
        changed: dict[str, int] = {}
        for r in rows:
            for part, n in r.get("changed", {}).items():
                changed[f"{r['target']} {part}"] = changed.get(f"{r['target']} {part}", 0) + n
        notes.append("State changed by refused cases, by the part that changed: "
                     + ", ".join(f"{k} {v:,}" for k, v in sorted(changed.items()))
                     + " (frames in raw.rows[].findings).")
    if bad == 0:
        notes.append("Every case ended in a value or a typed error; every refused case left "
                     "its state as it was.")
    return {"name": "fuzz", "title": "Fuzz campaign: every decoder of a peer's bytes",
            "what": "Structure-aware mutation of real frames of every message kind and of the "
                    "golden vLLM streams, plus Hypothesis draws over the wire types, through "
                    "every decoder (core codec and replica apply, replies, store handles, "
                    "recordings, seals, the executor channel's calls, the vLLM step, grammar and "
                    "reply decoders), with the C "
                    "kernels and in pure Python.",
            "columns": ["target", "kernels", "cases", "counted", "decoded", "accepted",
                        "rejected", "untyped", "state changed", "hangs", "errors"],
            "rows": table, "targets": targets, "notes": notes, "raw": result}


def from_hostile(result: dict[str, Any]) -> Fields:
    """``python -m engine_side.bench.hostile`` → one line per scenario (medians of the
    pairs' runs)."""
    rows: Sequence[dict[str, Any]] = result["rows"]
    pairs: dict[str, Any] = result["pairs"]
    table: list[list[Any]] = []
    for r in rows:
        if "pair" in r:
            continue
        table.append([r["scenario"], r["honest"], r["code"], r["steps_per_s"], None, None,
                      r["dead_events"], r["refused"], None])
    for name, p in pairs.items():
        table.append([name, p["honest"], None, p["flooded_steps_per_s"], p["base_steps_per_s"],
                      p["ratio"], p["dead_events"], int(p["refused"]),
                      p["engine_cpu_us_per_refused"]])
    targets = []
    for r in rows:
        if "pair" not in r:
            targets.append(target(f"{r['scenario']}: exact outputs, no honest rank flagged, "
                                   "exit 0", "yes" if r["honest"] else "no", "yes",
                                   r["honest"]))
    for name, p in pairs.items():
        if name.startswith("snapshot flood") and "sleeps" not in name or name.startswith(
                "handshake") and "uncapped" not in name:
            targets.append(target(f"{name}: steps/s with ÷ without", p["ratio"], "≥ 0.8",
                                   p["ratio"] is not None and p["ratio"] >= 0.8))
        if "uncapped" in name:
            targets.append(target(f"{name}: steps/s with ÷ without", p["ratio"], "reported",
                                   None))
        if name.startswith("snapshot flood"):
            targets.append(target(f"{name}: dead-rank events", p["dead_events"], "0",
                                   p["dead_events"] == 0))
            targets.append(target(f"{name}: engine CPU per rejected message (µs)",
                                   p["engine_cpu_us_per_refused"], "reported", None))
    return {"name": "hostile", "title": "Hostile peers against a real demo",
            "what": "deltacast demo --reference (two local workers) with a hostile peer beside "
                    "it: an allow-listed CURVE key of its own over tcp, or a process of the "
                    "same user on the ipc socket, running every attack; a snapshot-request "
                    "flood from one identity capped to a quarter core (cgroup CPU quota); a "
                    "flood of CURVE handshakes with unknown keys (capped to a quarter core, "
                    "then uncapped).",
            "columns": ["scenario", "honest", "exit", "steps/s", "steps/s without",
                        "÷ without", "dead events", "refused", "engine µs CPU per refused"],
            "rows": table, "targets": targets,
            "notes": [f"{result['requests']} requests per run; flood pairs are {result['reps']} "
                      "alternated runs without and with the peer, medians.",
                      "refused: the engine's count of messages not acted on (rank rules, rate "
                      "limits, undecodable, muted frames dropped undecoded, refused "
                      "handshakes). CPU per refused: the engine process's extra CPU time with "
                      "the flood ÷ refused messages, from the pair whose engine sleeps while "
                      "it waits (--ack-spin-ms 0; a spinning engine burns its core either way)."],
            "raw": result}
