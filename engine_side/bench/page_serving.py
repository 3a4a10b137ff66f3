"""The converter of the serving-latency benchmark's output
(:mod:`engine_side.bench.vllm_serving`) into a figures table (for
:mod:`engine_side.bench.page_tables`)."""

from __future__ import annotations

import statistics
from typing import Any

from engine_side.bench.page_common import NONE, Fields, target

#: (name, key in a run, sub-key, ratio key); lower is better for each
_MEASURES = (("ITL p50", "itl_ms", "p50", "itl_p50"), ("ITL p99", "itl_ms", "p99", "itl_p99"),
             ("TTFT p50", "ttft_ms", "p50", "ttft_p50"))
_NAMES = {r: label for label, _, _, r in _MEASURES} | {"tok_s": "tok/s"}


def _row(name: Any, default: dict[str, Any], delta: dict[str, Any],
         ratios: dict[str, float]) -> list[Any]:
    """The round ``name``: both ITL medians (ms), then Delta ÷ default of every measure
    (the other absolute figures stay in the raw output)."""
    cells: list[Any] = [name, round(default["itl_ms"]["p50"], 2),
                        round(delta["itl_ms"]["p50"], 2),
                        *(round(ratios[r], 3) for r in ("itl_p50", "itl_p99", "ttft_p50",
                                                        "tok_s"))]
    worse = [label for label, _, _, r in _MEASURES if ratios[r] > 1]
    if ratios["tok_s"] < 1:
        worse.append("throughput")
    return [*cells, ", ".join(worse) or NONE]


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"tok_s": statistics.median(r["tok_s"] for r in runs)}
    for _, key, sub, _ in _MEASURES:
        out.setdefault(key, {})[sub] = statistics.median(r[key][sub] for r in runs)
    return out


def from_serving(doc: dict[str, Any]) -> Fields:
    """``python -m engine_side.bench.vllm_serving`` document → per load one line per
    round, then the medians."""
    table, targets, spreads, steps = [], [], [], []
    for load in doc["loads"]:
        name, rounds, med = f"{load['rate']:g}/s", load["rounds"], load["median_ratios"]
        table += [[name, *_row(r["round"], r["default"], r["delta"], r["ratios"])]
                  for r in rounds]
        table.append([name, *_row("median", _median_run([r["default"] for r in rounds]),
                                  _median_run([r["delta"] for r in rounds]), med)])
        spreads.append(f"{name}: " + ", ".join(
            f"{_NAMES[k]} {min(r['ratios'][k] for r in rounds):.3f}–"
            f"{max(r['ratios'][k] for r in rounds):.3f}" for k in med))
        runs = [r[e] for r in rounds for e in ("default", "delta")]
        steps.append(f"{name} {statistics.median(x['steps'] for x in runs):,.0f}")
        targets.append(target(f"{name}: every request finished with all its tokens, every "
                              "run", bool(load["complete"]), "yes", bool(load["complete"])))
    n, base = doc["max_tokens"], doc.get("baseline", "default")
    if doc.get("hosts"):  # vllm_nodes --serving-rate: rank 1 on the other host
        section, title = "vllm_nodes_serving", ("Across two hosts: serving latency, "
                                                "DeltaExecutor against vLLM's multi-node mode")
        where = f"at TP={doc['tp']} with rank 1 in another network namespace ({doc['hosts']})"
        against = ("vLLM's multiprocessing executor with --nnodes 2 and a --headless node "
                   "(`deltacast node` for DeltaExecutor)")
        engine = "vLLM's defaults otherwise (max_model_len 256)"
        ids = "the batch runs of the section above compare token ids"
    else:
        section, title = "vllm_serving", "Serving latency: requests arriving over time"
        where, against = f"at TP={doc['tp']} on CPU", "vLLM's default executor"
        engine = (f"max_num_seqs {doc['max_running']}; enforce_eager, block size 32, no "
                  "prefix caching")
        ids = "the throughput benchmark above compares token ids"
    columns = ["load", "round", f"{base} ITL p50 ms", "Delta ITL p50 ms",
               *(f"{_NAMES[r]} ÷ {base}" for r in ("itl_p50", "itl_p99", "ttft_p50", "tok_s")),
               "slower on"]
    return {"name": section, "title": title,
            "what": f"Requests arriving as a Poisson process for {doc['seconds']:g} s at each "
                    f"load (mean arrivals a second; prompts of 16–112 tokens, "
                    f"{max(1, n // 2)}–{n * 3 // 2} output tokens, greedy) to a tiny random "
                    f"Llama {where}, an engine loop adding each at its time "
                    "and stepping LLMEngine as a server does, so requests join and leave "
                    "every few steps: inter-token latency (ITL) and time to first token "
                    f"(TTFT) per request, and output tokens/s, DeltaExecutor against "
                    f"{against}, each in a fresh process, alternating.",
            "columns": columns,
            "rows": table,
            "targets": targets,
            "notes": [f"Ratios are Delta ÷ {base} (ITL and TTFT: lower is better; tok/s: "
                      "higher); their spreads over the rounds: " + "; ".join(spreads) + ". "
                      "A median row is each column's median (its ratios: the medians of "
                      "the rounds' ratios).",
                      f"Engine steps per run (median): {', '.join(steps)}; {engine}; async "
                      "scheduling as vLLM chooses it; the engine core is a process of its "
                      "own, as behind a server.",
                      "Arrivals follow the wall clock, so which requests share a step "
                      f"differs between runs; {ids}."],
            "raw": doc}
