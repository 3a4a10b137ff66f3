"""Each benchmark's own output → the table of its figures envelope (columns, rows,
targets, notes) for :mod:`engine_side.bench.page`: the benchmarks' ``--figures FILE``
calls :func:`write_figures`; ``--import-report`` wraps the JSON ``deltacast report``
writes; ``--reconvert`` remakes a table from the stored raw output.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine_side.bench import figures
from engine_side.bench.page_common import NONE, Fields, target
from engine_side.bench.page_hostile import from_fuzz, from_hostile
from engine_side.bench.page_link import from_link
from engine_side.bench.page_nodes import from_nodes
from engine_side.bench.page_restarts import from_restarts
from engine_side.bench.page_serving import from_serving
from engine_side.bench.page_throughput import from_throughput

SLOWER = "slower on"  # the last column of a comparison: where deltacast is slower



def cell(value: Any) -> str:
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        size = abs(value)
        if size >= 100:
            return f"{value:,.0f}"
        if size >= 10:
            return f"{value:.1f}"
        if size >= 0.001:  # 3 significant digits; "1.00", not "1", for 0.9996 or 1.004
            text = f"{value:.3g}"
            return f"{value:#.3g}" if text in ("1", "-1") and value not in (1, -1) else text
        return f"{value:.1e}"
    return str(value).replace("|", "\\|").replace("\n", " ")



_cell = cell

# ---------------------------------------------------------------- helpers for converters
def _slower(*measures: tuple[str, float | None]) -> str:
    """The measures (name, ours ÷ theirs with lower better) on which deltacast is slower."""
    worse = [name for name, ratio in measures if ratio is not None and ratio > 1]
    return ", ".join(worse) if worse else NONE


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def _r(value: float | None, digits: int = 3) -> float | None:
    """``value`` rounded (ints, and None, as they are)."""
    if value is None or isinstance(value, int):
        return value
    return round(float(value), digits)



# ---------------------------------------------------------------- core
def from_core(rows: Sequence[dict[str, Any]]) -> Fields:
    """``deltacast bench [core] --json`` rows → one line per scenario and batch."""
    from engine_side.bench.core import check_targets

    by = {(r["scenario"], r["batch"], r["format"]): r for r in rows}
    cases = sorted({(r["scenario"], r["batch"]) for r in rows},
                   key=lambda c: (c[0] != "steady_decode", c[1]))
    table = []
    for scenario, batch in cases:
        ours, v1, full = (by.get((scenario, batch, f)) or {} for f in
                          ("deltacast", "pickle_v1", "pickle"))
        ratio = _div(ours.get("total_us"), v1.get("total_us"))
        table.append([scenario, batch, ours.get("bytes"), v1.get("bytes"), full.get("bytes"),
                      _r(_div(v1.get("bytes"), ours.get("bytes")), 1), ours.get("total_us"),
                      v1.get("total_us"), full.get("total_us"), _r(ratio),
                      _slower(("µs", ratio))])
    baseline = next((r.get("baseline") for r in rows if r["format"] == "pickle_v1"), None)
    notes = ["pickle_v1 is built from vLLM's own SchedulerOutput classes." if baseline == "vllm"
             else "pickle_v1 is built from a field-for-field stand-in of vLLM's SchedulerOutput "
                  "(vLLM was not importable).",
             "µs = encode + decode, the median per step; each format ran on the same steps in "
             "a rotating order (timed steps: 200 at batch ≤ 32, 100 at 256, 50 at 1024, 30 at "
             "4096).",
             "decode_tokens_blocks has the engine send every sampled token; steady_decode has "
             "the workers own them."]
    targets = [target(t.what, _r(t.value), f"≤ {t.limit:.3g}", t.met)
               for t in check_targets(list(rows))]
    return {"name": "core", "title": "Core: bytes and CPU time per step",
            "what": "Synthetic continuous-batching steps (engine_side/workloads.py) at batch "
                    "1 to 4096: median bytes on the wire and median CPU µs per step (encode + "
                    "decode, the worker's full rebuild included) of deltacast against "
                    "pickle_v1 (vLLM's execute_model RPC message with its SchedulerOutput, "
                    "pickled as its MessageQueue does) and pickle (the whole request).",
            "columns": ["scenario", "batch", "deltacast B", "pickle_v1 B", "pickle B",
                        "× fewer B than pickle_v1", "deltacast µs", "pickle_v1 µs",
                        "pickle µs", "µs ÷ pickle_v1", SLOWER],
            "rows": table, "targets": targets, "notes": notes, "raw": list(rows)}


# ---------------------------------------------------------------- latency
LATENCY_TARGETS = ((1, 256), (2, 256), (1, 4096), (2, 4096), (4, 4096))


def from_latency(rows: Sequence[dict[str, Any]]) -> Fields:
    """``deltacast bench latency --json`` rows → one line per worker count and batch."""
    by = {(r["transport"], r["workers"], r["batch"]): r for r in rows}
    cases = sorted({(r["workers"], r["batch"]) for r in rows})
    table, targets = [], []
    for workers, batch in cases:
        ipc, sockets, tcp, vllm = (by.get((t, workers, batch)) or {} for t in
                                   ("ipc", "ipc-sockets", "tcp-curve", "vllm-shm"))
        p50 = _div(ipc.get("total_us"), vllm.get("total_us"))
        cpu = _div(ipc.get("cpu_s_per_step"), vllm.get("cpu_s_per_step"))
        table.append([workers, batch, ipc.get("total_us"), ipc.get("p99_us"),
                      sockets.get("total_us"), tcp.get("total_us"), vllm.get("total_us"),
                      vllm.get("p99_us"), _ms(ipc.get("cpu_s_per_step")),
                      _ms(vllm.get("cpu_s_per_step")), _r(p50), _r(cpu),
                      _slower(("p50", p50), ("CPU", cpu))])
        if (workers, batch) in LATENCY_TARGETS and p50 is not None:
            targets.append(target(f"ipc p50 ÷ vLLM shm p50, {workers} worker"
                                   f"{'s' if workers > 1 else ''}, batch {batch}",
                                   _r(p50), "< 1", p50 < 1))
    steps: dict[int, set[int]] = {}
    for r in rows:
        steps.setdefault(r.get("steps") or 0, set()).add(r["batch"])
    timed = "; ".join(f"{n} at batch {', '.join(map(str, sorted(b)))}"
                      for n, b in sorted(steps.items(), key=lambda kv: min(kv[1])))
    return {"name": "latency", "title": "Step latency over real worker processes",
            "what": "steady_decode steps from the engine to 1, 2 and 4 worker processes: "
                    "latency from the engine handing over a step to every worker holding the "
                    "rebuilt request (p50, p99 µs) and CPU per step (engine + workers), for "
                    "the default ipc channel (shared-memory step ring), ipc without the ring, "
                    "tcp with CURVE, and vLLM's shared-memory MessageQueue carrying the "
                    "pickled SchedulerOutput (vllm shm).",
            "columns": ["workers", "batch", "ipc p50 µs", "ipc p99 µs", "ipc-sockets p50 µs",
                        "tcp-curve p50 µs", "vllm shm p50 µs", "vllm shm p99 µs",
                        "ipc CPU ms/step", "vllm shm CPU ms/step", "p50 ÷ vllm shm",
                        "CPU ÷ vllm shm", SLOWER],
            "rows": table, "targets": targets,
            "notes": ["Ratios compare ipc with vllm shm; the vLLM lane's clock starts at "
                      "enqueue (building its SchedulerOutput is left out), ours before the "
                      "diff.",
                      f"Timed steps per case: {timed}; both sides spin with sched_yield "
                      "while they wait, as vLLM's readers do."],
            "raw": list(rows)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


# ---------------------------------------------------------------- multimodal
MM_FORMATS = ("memcpy", "pickle_torch", "pickle_numpy", "frames", "store_first", "store_hit",
              "vllm_shm")


def from_mm(rows: Sequence[dict[str, Any]]) -> Fields:
    """``deltacast bench mm --json`` rows → total ms per image count and worker count."""
    by = {(r["batch"], r["workers"], r["format"]): r for r in rows}
    cases = sorted({(r["batch"], r["workers"]) for r in rows})
    table = []
    for batch, workers in cases:
        cell = {f: (by.get((batch, workers, f)) or {}).get("total_us") for f in MM_FORMATS}
        first = _div(cell["store_first"], cell["vllm_shm"])
        frames = _div(cell["frames"], cell["vllm_shm"])
        table.append([batch, workers, *(_ms_from_us(cell[f]) for f in MM_FORMATS),
                      _r(first), _r(frames),
                      _slower(("store_first", first), ("frames", frames))])
    targets = []
    top = max(b for b, _ in cases)
    for batch, workers in cases:
        if batch != top:
            continue
        memcpy = (by.get((batch, workers, "memcpy")) or {}).get("total_us")
        frames_enc = (by.get((batch, workers, "frames")) or {}).get("encode_us")
        first = (by.get((batch, workers, "store_first")) or {}).get("total_us")
        share = _div(frames_enc, memcpy)
        if share is not None:
            targets.append(target(f"frames encode ÷ memcpy, {batch} images, {workers} "
                                   f"worker{'s' if workers > 1 else ''}", _r(share, 4), "≤ 0.1",
                                   share <= 0.1))
        ratio = _div(first, memcpy)
        if ratio is not None:
            targets.append(target(f"store_first ÷ memcpy, {batch} images, {workers} "
                                   f"worker{'s' if workers > 1 else ''}", _r(ratio), "≤ 1.5",
                                   ratio <= 1.5))
    hits = [r["bytes"] / r["batch"] for r in rows if r["format"] == "store_hit"]
    if hits:
        worst = max(hits)
        targets.append(target("store_hit bytes per image (worst case)", round(worst, 1),
                               "≤ 100", worst <= 100))
    repeats = sorted({int(r["repeats"]) for r in rows if r.get("repeats")}, reverse=True)
    return {"name": "mm", "title": "Multimodal: pixel tensors to local workers",
            "what": "Images of 3×896×896 float32 pixels (9.6 MB each) sent from the engine "
                    "process to 1, 2 and 4 worker processes: ms until every worker holds "
                    "every tensor, for a plain in-process copy (memcpy, the yardstick), "
                    "vLLM-style pickles over zmq, deltacast's zero-copy tensor frames, "
                    "deltacast's shared-memory store (first send and repeat), and vLLM 0.32's "
                    "shared-memory object storage (vllm_shm).",
            "columns": ["images", "workers", *(f"{f} ms" for f in MM_FORMATS),
                        "store_first ÷ vllm_shm", "frames ÷ vllm_shm", SLOWER],
            "rows": table, "targets": targets,
            "notes": [f"Median of {'/'.join(map(str, repeats))} repeats (fewer for more "
                      "images); one format at a time, workers drop everything between "
                      "formats.",
                      "memcpy copies into tensors written once beforehand, as store_first writes "
                      "into pages the store faulted in when it was made."],
            "raw": list(rows)}


def _ms_from_us(us: float | None) -> float | None:
    return None if us is None else round(us / 1e3, 2)


# ---------------------------------------------------------------- wire-size report
def from_report(report: dict[str, Any]) -> Fields:
    """``docs/report/report.json`` → its headline table with ratios."""
    table = []
    for h in report["headline"]:
        w = next(s for s in report["workloads"] if s["workload"] == h["workload"])
        ours, v1 = w["formats"]["deltacast"], w["formats"]["pickle_v1"]
        ratio = _div(ours["total_us"]["p50"], v1["total_us"]["p50"])
        table.append([h["workload"], h["batch"], h["deltacast"], h["msgspec_full"],
                      h["pickle_v1"], h["pickle"], h["pickle_v1 / deltacast"],
                      h["deltacast µs p50"], h["pickle_v1 µs p50"], _r(ratio),
                      _slower(("µs", ratio))])
    labels = sorted({w["labels"].get("pickle_v1", "") for w in report["workloads"]} - {""})
    return {"name": "report", "title": "Wire-size report",
            "what": "Six synthetic workloads (decode_heavy, long_prefill, preemption_storm, "
                    "spec_decode, multimodal, mixed_chat) replayed through four formats side "
                    "by side: mean bytes per step and the median encode + decode µs per step "
                    "of deltacast against pickle_v1 (vLLM's SchedulerOutput RPC message).",
            "columns": ["workload", "batch", "deltacast B/step", "msgspec_full B/step",
                        "pickle_v1 B/step", "pickle B/step", "× fewer B than pickle_v1",
                        "deltacast µs p50", "pickle_v1 µs p50", "µs ÷ pickle_v1", SLOWER],
            "rows": table, "targets": [],
            "notes": ["pickle_v1 is built from vLLM's own SchedulerOutput classes."
                      if labels and all(x.endswith("(vllm)") for x in labels) else
                      f"pickle_v1: {', '.join(labels) or 'unlabelled'}.",
                      "deltacast's µs: EngineMirror.step of what the step changed and the "
                      "encode, then the decode and a replica's apply; what changed is found "
                      "untimed (an engine knows it, as vLLM's SchedulerOutput is it), as the "
                      "pickle formats' objects are built untimed.",
                      "msgspec_full is the whole request in msgspec, without deltas; per-field "
                      "splits, percentiles and plots are in docs/report/report.md."],
            "raw": {"headline": report["headline"], "command": report.get("command")}}


def import_report(path: Path, out: Path) -> dict[str, Any]:
    """The envelope of the report at ``path`` (written by ``deltacast report`` just before):
    its date is the report's start (file time less its run time), the commit and machine
    this checkout's."""
    report = json.loads(path.read_text())
    fields = from_report(report)
    written = path.stat().st_mtime
    seconds = float(report.get("seconds", 0.0))
    started = datetime.datetime.fromtimestamp(written - seconds, datetime.UTC)
    dirty = figures.dirty_paths()
    stamp = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "commit": figures.commit(),
             "dirty": dirty, "load": None, "_t0": 0.0}
    run = report.get("command") or "deltacast report"
    command = (f"{figures.env_prefix()}.venv/bin/{run} && .venv/bin/python -m "
               f"engine_side.bench.page --import-report {_repo_path(path)}")
    env = figures.envelope(**fields, started=stamp, command_line=command)
    env["seconds"] = seconds
    env.pop("load", None)
    env.pop("load_end", None)
    figures.dump(out, env)
    return env


def _repo_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(figures.ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------- vLLM streams
def from_streams(doc: dict[str, Any]) -> Fields:
    """``python -m engine_side.bench.vllm_streams`` document → one line per stream."""
    from engine_side.bench.vllm_table import minimal_ratios, streams
    from engine_side.bench.vllm_table import targets as stream_targets

    def median(p: dict[str, Any], of: str = "vllm") -> float | None:
        return _div(p["median_us"], p[f"median_{of}_us"]) if p["steps"] else None

    table = []
    for name, w in streams(doc):
        req, steps = w["request"], max(1, w["steps"])
        fewer = _div(req["vllm_bytes"], req["bytes"])
        med, bare = median(req), median(req, "bare")
        summed = _div(req["us"], req["vllm_us"])
        join, same = w["join_leave"], w["same_batch"]
        join_r, same_r = median(join), median(same)
        reply = _div(w["reply"]["vllm_bytes"], w["reply"]["bytes"])
        table.append([name, w["steps"], round(req["bytes"] / steps, 1),
                      round(req["vllm_bytes"] / steps, 1), _r(fewer, 1), _r(req["median_us"], 1),
                      _r(req["median_vllm_us"], 1), _r(med), _r(bare),
                      _r(_div(req.get("median_floor_us"), req["median_bare_us"])),
                      *map(_r, minimal_ratios(req)),
                      _r(summed),
                      join["steps"], _r(join_r), _r(same_r), _r(reply, 1),
                      _slower(("median", med), ("summed", summed), ("join/leave", join_r),
                              ("same-batch", same_r))])
    t = doc["total"]["request"]
    steps = max(1, sum(w["steps"] for w in doc["workloads"].values()))
    fewer, summed = _div(t["vllm_bytes"], t["bytes"]), _div(t["us"], t["vllm_us"])
    join_steps = sum(w["join_leave"]["steps"] for w in doc["workloads"].values())
    reply_t = doc["total"]["reply"]
    table.append(["all recorded", steps, round(t["bytes"] / steps, 1),
                  round(t["vllm_bytes"] / steps, 1), _r(fewer, 1), None, None, None, None,
                  _r(_div(t["floor_us"], t["bare_us"])) if "floor_us" in t else None,
                  *map(_r, minimal_ratios(t, summed=True)),
                  _r(summed), join_steps, None, None,
                  _r(_div(reply_t["vllm_bytes"], reply_t["bytes"]), 1),
                  _slower(("summed", summed))])
    meta = doc.get("meta", {})
    checks = [w["check"] for _, w in streams(doc) if "check" in w]
    notes = ["vLLM = its MessageQueue serializer of the same message (what a vLLM executor "
             "pays per message), bare = bare pickle.dumps + loads of it; each step's µs is "
             f"the median of {meta.get('passes', 1)} replays, the paths taking turns "
             "at going first.",
             "µs = encode + decode of the request path (execute_model + sample_tokens) per "
             "step; median = ratio of the median steps, summed = ratio of the sums over all "
             "steps, join/leave = steps where a request joins, leaves, is preempted or "
             "resumes (their median), same-batch = the others.",
             "synthetic-N: N requests in steady decode, all of them joining in the first of "
             "its steps; synthetic-churn-N: one request finishes and one joins every step (a "
             "stateful channel's worst case).",
             "floor = the step's SchedulerOutput built in Python from its own lists with "
             "fresh containers, nothing decoded (vllm_replay.rebuilt_in_python): the least a "
             "Python rank does to hand its runner a plain object; floor ÷ bare is its "
             "median step against bare pickle's (all recorded: summed).",
             "minimal = a minimal stateful channel (engine_side/bench/minimal_stateful.py, "
             "execute_model only; a subset of deltacast's work, see Limits): its median "
             "step against vLLM's serializer's (all recorded: summed); + digest: the same "
             "keeping a state digest of deltacast's terms on both ends.",
             "Targets are judged against vLLM's serializer; the ratios against bare pickle "
             "(bare) and of the minimal stateful channel without and with a digest (minimal, "
             "+ digest) follow each in brackets."]
    if checks:
        notes.append(f"{len(checks)} streams checked: {sum(c['records'] for c in checks):,} "
                     "messages decoded and compared with the originals, "
                     f"{sum(c['differences'] for c in checks)} differences.")
    if "kernels" in meta:
        notes.append("The protocol's C kernels were in use." if meta["kernels"] else
                     "The protocol ran its pure-Python kernels.")
    targets = [target(t["target"] + _beside(t), t["value"], t["limit"], t["met"])
               for t in stream_targets(doc)]
    recorded = len(doc["workloads"])
    return {"name": "vllm_streams", "title": "vLLM streams",
            "what": f"vLLM's own per-step messages, recorded from real vLLM CPU runs of "
                    f"{recorded} workloads (coverage, batch and online scenarios: "
                    "engine_side/bench/vllm_scenarios.py, vllm_online.py) and synthetic "
                    "streams, replayed through deltacast's encoder and decoder, vLLM's "
                    "MessageQueue serializer and bare pickle: request bytes and CPU µs per "
                    "step.",
            "columns": ["stream", "steps", "B/step", "vLLM B/step", "× fewer B",
                        "median µs", "vLLM median µs", "median ÷ vLLM", "median ÷ bare",
                        "floor ÷ bare", "minimal ÷ vLLM", "+ digest ÷ vLLM", "summed ÷ vLLM",
                        "join/leave steps",
                        "join/leave median ÷ vLLM", "same-batch median ÷ vLLM",
                        "× fewer reply B", SLOWER],
            "rows": table, "targets": targets, "notes": notes, "raw": doc}


def _beside(target: dict[str, Any]) -> str:
    """A stream target's bare-pickle and minimal-channel ratios, in brackets."""
    parts = [f"{label}: {_cell(target[key])}" for key, label in
             (("bare", "bare"), ("minimal", "minimal"), ("digested", "+ digest"))
             if target.get(key) is not None]
    return f" ({'; '.join(parts)})" if parts else ""


# ---------------------------------------------------------------- structured-output bitmask
def from_bitmask(results: Sequence[dict[str, Any]]) -> Fields:
    """``python -m engine_side.bench.bitmask`` results → one line per case."""
    table = [[r["requests"], r["vocab"], r["raw_bytes"], r["bytes"], r["pickle_bytes"],
              _r(r["bytes_ratio"], 1), _r(r["us"], 1), _r(r["pickle_us"], 1),
              _r(r["us_ratio"]), _r(r["ring_us"], 1), _r(r["ring_ratio"]),
              _slower(("µs", r["us_ratio"]), ("µs with ring copies", r["ring_ratio"]))]
             for r in results]
    return {"name": "bitmask", "title": "Structured-output bitmasks",
            "what": "sample_tokens messages carrying xgrammar-like GrammarOutput bitmasks "
                    "(rows shared by requests at the same grammar state, states recurring "
                    "across steps) at 512- and 128,256-token vocabularies: bytes and µs per "
                    "message of deltacast's grammar encoder + decoder against vLLM's "
                    "MessageQueue serializer, alone and with the two copies its shared-memory "
                    "ring makes of the message.",
            "columns": ["requests", "vocabulary", "bitmask B", "deltacast B", "vLLM B",
                        "× fewer B", "deltacast µs", "vLLM µs", "µs ÷ vLLM",
                        "vLLM + ring copies µs", "µs ÷ that", SLOWER],
            "rows": table, "targets": [],
            "notes": ["Medians over the timed messages (--reps, default 21); every decoded "
                      "bitmask is checked equal to the original."],
            "raw": list(results)}


CONVERTERS: dict[str, Callable[[Any], Fields]] = {
    "core": from_core, "latency": from_latency, "mm": from_mm, "report": from_report,
    "vllm_streams": from_streams, "vllm_throughput": from_throughput, "bitmask": from_bitmask,
    "fuzz": from_fuzz, "hostile": from_hostile, "vllm_nodes": from_nodes,
    "vllm_link": from_link, "vllm_restarts": from_restarts, "vllm_serving": from_serving,
    "vllm_nodes_serving": from_serving}


def reconvert(path: Path) -> bool:
    """Remake the table of the envelope at ``path`` from its ``raw`` output with the current
    converter (the run's command, machine, date and commit stay); False when it has none."""
    env = figures.load(path)
    if env.get("raw") is None or env["name"] not in CONVERTERS or env["name"] == "report":
        return False
    fields = CONVERTERS[env["name"]](env["raw"])
    fields.pop("raw", None)
    if {k: env.get(k) for k in fields} == fields:
        return False
    env.update(fields)
    figures.dump(path, env)
    return True


def write_figures(path: str | Path, kind: str, native: Any,
                  started: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a benchmark's ``--figures FILE`` calls at the end: its own output → envelope."""
    fields = CONVERTERS[kind](native)
    return figures.write(path, started=started, **fields)


