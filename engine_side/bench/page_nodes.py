"""The converter of the two-host benchmark's output (:mod:`engine_side.bench.vllm_nodes`)
into a figures table (for :mod:`engine_side.bench.page_tables`)."""

from __future__ import annotations

import statistics
from typing import Any

from engine_side.bench.page_common import NONE, Fields, target


def _row(name: Any, vllm: float, delta: float, vllm_b: float, delta_b: float,
         vllm_c: float, delta_c: float, ratio: float | None = None,
         fewer: float | None = None) -> list[Any]:
    ratio = delta / vllm if ratio is None else ratio
    fewer = vllm_b / max(delta_b, 1) if fewer is None else fewer
    slower = ", ".join(w for w, bad in (("throughput", ratio < 1), ("bytes", fewer < 1)) if bad)
    return [name, round(vllm, 1), round(delta, 1), round(ratio, 3), round(vllm_b),
            round(delta_b), round(fewer, 1), round(vllm_c), round(delta_c), slower or NONE]


def from_nodes(doc: dict[str, Any]) -> Fields:
    """``python -m engine_side.bench.vllm_nodes`` document → one line per round."""
    s = doc["summary"]
    rounds = s["rounds"]
    keys = ("vllm", "delta", "vllm_channel", "delta_channel", "vllm_collectives",
            "delta_collectives")
    table = [_row(r["round"], *(r[k] for k in keys)) for r in rounds]
    ratios = [r["delta"] / r["vllm"] for r in rounds]
    fewer = statistics.median(r["vllm_channel"] / max(r["delta_channel"], 1) for r in rounds)
    v, d, vb, db, vc, dc = (statistics.median(r[k] for r in rounds) for k in keys)
    table.append(_row("median", v, d, vb, db, vc, dc, ratio=statistics.median(ratios),
                      fewer=fewer))
    targets = [
        target("step channel bytes between the hosts, × fewer (median of rounds)",
                round(fewer, 1), "≥ 15", fewer >= 15),
        target("DeltaExecutor ÷ vLLM multi-node throughput, median of rounds",
                round(s["ratio"], 3), "≥ 1", s["ratio"] >= 1),
        target("token ids identical in every run", s["identical"], "yes", s["identical"])]
    for f in doc["faults"]:
        seen = f.get("detected_s")
        targets.append(target(f"rank 1 {_FAULT[f['fault']]}: seconds until generate raised",
                               None if seen is None else round(seen, 2), "≤ 1",
                               seen is not None and seen <= 1))
    runs = len(ratios)
    notes = [f"{runs} rounds, alternating which executor starts; each run {doc['prompts']} "
             f"prompts × {doc['max_tokens']} tokens after a warm-up generate, in a fresh "
             f"engine and node. Throughput ratios: spread {min(ratios):.3f}–{max(ratios):.3f}, "
             f"{sum(x >= 1 for x in ratios)} of {runs} ≥ 1. The median row is each column's "
             "median (its ratios: the medians of the rounds' ratios).",
             "Channel: bytes both ways on the engine process's TCP sockets to the other host "
             "(calls and replies: vLLM's message queue, pickled; deltacast's ROUTER, CURVE); "
             "collectives: the ranks' sockets (gloo, the same work for both).",
             f"Link: {doc['link']}. Fault times run from the signal (or the link going down) "
             "to the exception in the engine's process, so they include vLLM's own "
             "propagation of the executor's failure."]
    return {"name": "vllm_nodes", "title": "Across two hosts: TP=2, DeltaExecutor against "
                                           "vLLM's multi-node mode",
            "what": "LLM.generate at TP=2 with rank 1 in another network namespace (a veth "
                    "pair at 1 Gbit/s): DeltaExecutor with `deltacast node` against vLLM's "
                    "multiprocessing executor with `--nnodes 2` and a `--headless` node: "
                    "output tokens/s, bytes between the hosts per run, and the time to "
                    "detect a remote rank killed, frozen or cut off.",
            "columns": ["round", "vLLM tok/s", "DeltaExecutor tok/s", "Delta ÷ vLLM",
                        "vLLM channel B", "Delta channel B", "× fewer channel B",
                        "vLLM collectives B", "Delta collectives B", "slower on"],
            "rows": table, "targets": targets, "notes": notes, "raw": doc}


_FAULT = {"kill": "killed (SIGKILL)", "stop": "frozen (SIGSTOP)", "link": "link down"}
