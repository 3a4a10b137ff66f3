"""The converter of the two-host step-latency benchmark's output
(:mod:`engine_side.bench.vllm_link`) into a figures table (for
:mod:`engine_side.bench.page_tables`)."""

from __future__ import annotations

from typing import Any

from engine_side.bench.page_common import NONE, Fields, target


def _row(w: dict[str, Any]) -> list[Any]:
    fewer = w["vllm_bytes_per_step"] / max(w["ours_bytes_per_step"], 1)
    slower = ", ".join(name for name, bad in (("median", w["ratio_median_us"] > 1),
                                              ("p99", w["ratio_p99_us"] > 1),
                                              ("bytes", fewer < 1)) if bad)
    return [f"{w['workload']}-{w['running']}", w["running"], w["steps"],
            round(w["ours_median_us"], 1), round(w["vllm_median_us"], 1),
            round(w["ratio_median_us"], 3), round(w["ours_p99_us"], 1),
            round(w["vllm_p99_us"], 1), round(w["ratio_p99_us"], 3),
            round(w["ours_bytes_per_step"]), round(w["vllm_bytes_per_step"]), round(fewer, 1),
            slower or NONE]


def from_link(doc: dict[str, Any]) -> Fields:
    """``python -m engine_side.bench.vllm_link`` document → one line per workload."""
    rows = doc["summary"]
    table = [_row(w) for w in rows]
    targets = [target(f"step latency at 1 Gbit/s, ours ÷ vLLM's MessageQueue (median), "
                       f"{w['workload']}-{w['running']}", round(w["ratio_median_us"], 3),
                       "< 1", w["ratio_median_us"] < 1) for w in rows]
    if doc.get("checked"):
        targets.append(target("steps the rank held that differ from the originals",
                               doc["differences"], "0", doc["differences"] == 0))
    spread = "; ".join(f"{w['workload']}-{w['running']} "
                       f"{min(w['ratios_median_us']):.3f}–{max(w['ratios_median_us']):.3f}"
                       for w in rows)
    first = "; ".join(f"{w['workload']}-{w['running']} {round(w['ours_first_tx_bytes']):,} / "
                      f"{round(w['vllm_first_tx_bytes']):,} B" for w in rows)
    spin = "?" if doc.get("spin_ms") is None else f"{doc['spin_ms']:g} ms"
    floor = doc.get("floor")
    notes = [f"{doc['rounds']} rounds, alternating which path goes first, after one "
             "untimed warm-up run of each; each cell is the median over rounds of the "
             "run's median (or p99) over its steps; the ratios are the medians of the "
             f"rounds' ratios (spread of the median ratio: {spread}).",
             "Latency runs from the engine starting to hand a step over (ours: before "
             "encoding; vLLM: before enqueue, its pickling included) to the remote rank "
             "holding it (ours: the decoded SchedulerOutput reaching the worker's "
             "execute_model under the rank's own call loop; vLLM: dequeue returned), on the "
             "machine's one monotonic clock; lockstep: the next step leaves once the rank "
             "has answered (ours: its K reply on the DEALER; vLLM: an empty message on a "
             "plain TCP ZMQ socket).",
             "decode-N: N requests in steady decode, all joining in the first step; "
             "churn-N: one request finishes and one (500 prompt tokens) joins every step" + (
                 f"; {', '.join(f'{n}-N' for n in doc['streams'])}: a recorded vLLM run "
                 "(vllm_streams), N "
                 "its median running requests, joins and leaves as the server had them; the "
                 "sample_tokens message after each of its steps rides along (checked, its "
                 "bytes in its step's, not timed)" if doc.get("streams") else "") + ". One "
             "step = one execute_model message.",
             "Bytes: the engine host's veth tx bytes over a run ÷ steps (Ethernet, IP and TCP "
             "headers and TCP acks included; ours CURVE-encrypted, vLLM's plain); the first "
             f"step alone (synthetic: every request joining), ours / vLLM's: {first}.",
             f"Link: {doc['link']}; both hosts share the machine's 2 cores. Our rank's spin "
             f"after each answer: {spin} (the executor tells remote ranks not to spin); "
             "vLLM's remote reader blocks in poll, as vLLM's does."]
    if floor:
        m = {k: round(v["median_us"]) for k, v in floor["modes"].items()}
        notes.append(f"The transport's floor (--floor; engine_side/bench/link_floor.py: no "
                     f"deltacast code, {floor['bytes']} B a step, median): one plain TCP hop "
                     f"{m['plain']} µs, one CURVE hop {m['curve']} µs, CURVE to a relay "
                     f"process then a node ring and doorbell {m['relayed']} µs.")
    return {"name": "vllm_link", "title": "Across two hosts: step latency, deltacast's "
                                          "channel against vLLM's MessageQueue",
            "what": "Synthetic vLLM steps (steady decode and churn at 256 and 4096 running "
                    "requests) and recorded vLLM runs from an engine in one network namespace "
                    "to one rank in another over a veth pair at 1 Gbit/s: deltacast's encoder, "
                    "CURVE ROUTER → the node's relay (a process of its own) → the node's step "
                    "ring (the rank woken by its doorbell FIFO), and decoder, against vLLM's "
                    "MessageQueue with a remote (TCP) reader carrying the pickled execute_model "
                    "RPC; per-step latency until the rank holds the step (median, p99 µs) and "
                    "bytes on the wire.",
            "columns": ["workload", "running", "steps", "ours median µs", "vLLM median µs",
                        "median ÷ vLLM", "ours p99 µs", "vLLM p99 µs", "p99 ÷ vLLM",
                        "ours B/step", "vLLM B/step", "× fewer B", "slower on"],
            "rows": table, "targets": targets, "notes": notes, "raw": doc}
