"""The converter of the TP=2 throughput benchmark's output
(:mod:`engine_side.bench.vllm_throughput`) into a figures table (for
:mod:`engine_side.bench.page_tables`)."""

from __future__ import annotations

import statistics
from typing import Any

from engine_side.bench.page_common import NONE, Fields, target


def _workload(running: int) -> str:
    if not running:
        return "batch"
    return f"{running} running"


def _row(name: str, rnd: Any, default: float, delta: float, ratio: float, cpu_default: float,
         cpu_delta: float) -> list[Any]:
    return [name, rnd, round(default), round(delta), round(ratio, 3), round(cpu_default, 3),
            round(cpu_delta, 3), "throughput" if ratio < 1 else NONE]


def from_throughput(doc: dict[str, Any]) -> Fields:
    """``python -m engine_side.bench.vllm_throughput`` document → one line per workload
    and round, then the workload's medians."""
    table, targets, spreads = [], [], []
    for w in doc["workloads"]:
        name, rounds = _workload(w["running"]), w["rounds"]
        table += [_row(name, r["round"], r["default"], r["delta"], r["ratio"],
                       r["default_cpu_ms_per_token"], r["delta_cpu_ms_per_token"])
                  for r in rounds]
        ratios = [r["ratio"] for r in rounds]
        median = statistics.median(ratios)
        med = {k: statistics.median(r[k] for r in rounds) for k in
               ("default", "delta", "default_cpu_ms_per_token", "delta_cpu_ms_per_token")}
        table.append(_row(name, "median", med["default"], med["delta"], median,
                          med["default_cpu_ms_per_token"], med["delta_cpu_ms_per_token"]))
        targets += [target(f"{name}: DeltaExecutor ÷ default throughput, median of rounds",
                            round(median, 3), "≥ 1", median >= 1),
                    target(f"{name}: token ids identical in every process",
                            bool(w["outputs_identical"]), "yes", bool(w["outputs_identical"]))]
        spreads.append(f"{name} median {median:.3f}, spread {min(ratios):.3f}–"
                       f"{max(ratios):.3f}, {sum(x >= 1 for x in ratios)} of {len(ratios)} ≥ 1")
    n = doc["max_tokens"]
    return {"name": "vllm_throughput", "title": "End-to-end throughput at TP=2",
            "what": f"LLM.generate of {doc['prompts']} prompts on a tiny random Llama at "
                    f"TP={doc['tp']} on CPU, DeltaExecutor against vLLM's default executor, "
                    "each in a fresh process, alternating: output tokens/s (median of the "
                    "timed generates) and CPU ms per output token of the whole process tree. "
                    f"batch: every prompt admitted at the first step, {n} output tokens each; "
                    f"N running: at most N requests running (max_num_seqs), output lengths "
                    f"{max(1, n // 2)}–{n * 3 // 2}, so as requests finish the waiting ones "
                    f"join (on average one every {n}/N steps).",
            "columns": ["workload", "round", "default tok/s", "DeltaExecutor tok/s",
                        "Delta ÷ default", "default CPU ms/token", "Delta CPU ms/token",
                        "slower on"],
            "rows": table, "targets": targets,
            "notes": ["Ratios of the rounds: " + "; ".join(spreads) + ". A model step of "
                      "this tiny model is milliseconds of compute, so the channel's µs barely "
                      "show and the spread is the shared machine's.",
                      "A median row is each column's median (its ratio: the median of the "
                      "rounds' ratios).",
                      f"{doc['repeats']} timed generates per process after a warm-up; "
                      "enforce_eager, block size 32, no prefix caching."],
            "raw": doc}
