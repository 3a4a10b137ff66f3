"""The fuzz campaign's tallies (per target, summed over its shards) and the decoders'
branch coverage combined (:mod:`engine_side.bench.fuzz`)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Tally:
    """One target's outcome in one shard."""

    cases: int = 0
    counted: int = 0
    decoded: int = 0  # came out as a value
    accepted: int = 0  # and applied to a state
    rejected: int = 0  # a ProtocolError subclass
    untyped: int = 0
    violations: int = 0  # refused, yet the state changed
    hangs: int = 0
    hypothesis: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    hows: Counter[str] = field(default_factory=Counter)
    changed: Counter[str] = field(default_factory=Counter)  # refused, yet this part changed
    findings: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON values (``dataclasses.asdict`` would turn a Counter's items into
        counted pairs)."""
        return {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}

    def merge(self, other: dict[str, Any]) -> None:
        for key, value in other.items():
            if isinstance(value, int):
                setattr(self, key, getattr(self, key) + value)
            elif isinstance(value, dict):
                getattr(self, key).update(value)
            else:
                self.findings += value[: max(0, 20 - len(self.findings))]


def summarize(shards: list[dict[str, Any]], crashes: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[tuple[str, str], Tally] = {}
    for shard in shards:
        for target, tally in shard["tallies"].items():
            by.setdefault((target, shard["kernels"]), Tally()).merge(tally)
    rows = [{"target": t, "kernels": k, **{f: getattr(v, f) for f in (
        "cases", "counted", "decoded", "accepted", "rejected", "untyped", "violations",
        "hangs", "hypothesis")}, "errors": dict(v.errors.most_common(8)),
        "changed": dict(v.changed),
        "hows": len(v.hows), "findings": v.findings}
        for (t, k), v in sorted(by.items()) if v.cases]
    return {"rows": rows, "crashes": crashes, "shards": len(shards),
            "cpu_seconds": round(sum(s["seconds"] for s in shards), 1),
            "cases": sum(r["cases"] for r in rows), "counted": sum(r["counted"] for r in rows),
            "untyped": sum(r["untyped"] for r in rows),
            "violations": sum(r["violations"] for r in rows),
            "hangs": sum(r["hangs"] for r in rows) + sum(c["hang"] for c in crashes),
            "crashed": len([c for c in crashes if not c["hang"]])}


def branch_coverage(work: Path) -> dict[str, Any]:
    """Combined branch coverage of the decoder modules over every shard."""
    import coverage

    cov = coverage.Coverage(branch=True, data_file=str(work / ".coverage"))
    cov.combine([str(p) for p in work.glob(".coverage.*")])
    data = cov.get_data()
    files: dict[str, Any] = {}
    total = [0, 0, 0, 0]  # statements, run, branches, taken
    for path in sorted(data.measured_files()):
        analysis = cov._analyze(path)  # coverage's own numbers (statements and arcs)
        nums = analysis.numbers
        rel = os.path.relpath(path, ROOT)
        files[rel] = {"statements": nums.n_statements, "run": nums.n_executed,
                      "branches": nums.n_branches,
                      "taken": nums.n_branches - nums.n_missing_branches,
                      "percent": round(nums.pc_covered, 1)}
        for i, v in enumerate((nums.n_statements, nums.n_executed, nums.n_branches,
                               nums.n_branches - nums.n_missing_branches)):
            total[i] += v
    return {"files": files, "statements": total[0], "run": total[1], "branches": total[2],
            "taken": total[3],
            "branch_percent": round(100 * total[3] / max(total[2], 1), 1),
            "line_percent": round(100 * total[1] / max(total[0], 1), 1)}
