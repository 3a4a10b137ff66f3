"""Markdown tables and target verdicts of a ``vllm_streams`` replay document (JSON).

``render(doc)`` prints the tables of the document
``python -m engine_side.bench.vllm_streams --json FILE`` writes; ``targets(doc)``
judges issue 35's targets on the same figures.  Every ratio is deltacast ÷ the other
path: targets are judged against vLLM's own serializer of the message (its
MessageQueue's, ``vllm_replay.vllm_serialize``: "vLLM") and reported also against
bare ``pickle.dumps`` + ``loads`` ("bare"); byte ratios are "× fewer".
"""

from __future__ import annotations

from typing import Any

MEDIAN_LIMIT = 1.0  # median request µs per step, every stream
JOIN_LIMIT = 1.5  # median request µs of join/leave steps, every recorded workload
SUMMED_LIMIT = 0.7  # request µs summed over the recorded workloads
BYTES_TARGET = 15.0  # × fewer request bytes summed over the recorded workloads
CHURN = "churn-"  # synthetic continuous batching: a join and a finish every step
FIELDS_SHOWN = 4


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def _n(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"


def _x(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.1f}×" if v < 100 else f"{v:,.0f}×"


def _r(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def streams(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, summary) of every stream: the recorded workloads, then ``synthetic-NAME``."""
    return [*doc["workloads"].items(),
            *((f"synthetic-{k}", v) for k, v in doc.get("synthetic", {}).items())]


def _median(p: dict[str, Any], of: str = "vllm") -> float | None:
    return _div(p["median_us"], p[f"median_{of}_us"]) if p["steps"] else None


# ---------------------------------------------------------------- tables
def table(doc: dict[str, Any], path: str) -> str:
    """One row per stream of ``path`` ("request" or "reply"), then the recorded totals."""
    head = ["| stream | steps | running (median / max) | B/step | vLLM B/step | × fewer B | "
            "median µs | vLLM median µs | bare median µs | median ÷ vLLM | median ÷ bare | "
            "summed ÷ vLLM | summed ÷ bare |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
            "---: | ---: |"]
    rows = []
    for name, w in streams(doc):
        p, steps = w[path], max(1, w["steps"])
        rows.append(f"| {name} | {w['steps']} | {w['median_running']:g} / {w['max_running']} | "
                    f"{_n(p['bytes'] / steps)} | {_n(p['vllm_bytes'] / steps)} | "
                    f"{_x(_div(p['vllm_bytes'], p['bytes']))} | {_n(p['median_us'])} | "
                    f"{_n(p['median_vllm_us'])} | {_n(p['median_bare_us'])} | "
                    f"{_r(_median(p))} | {_r(_median(p, 'bare'))} | "
                    f"{_r(_div(p['us'], p['vllm_us']))} | {_r(_div(p['us'], p['bare_us']))} |")
    t = doc["total"][path]
    steps = max(1, sum(w["steps"] for w in doc["workloads"].values()))
    rows.append(f"| **all recorded** | {steps} | | {_n(t['bytes'] / steps)} | "
                f"{_n(t['vllm_bytes'] / steps)} | **{_x(_div(t['vllm_bytes'], t['bytes']))}** | "
                f"{_n(t['us'] / steps)} (mean) | {_n(t['vllm_us'] / steps)} (mean) | "
                f"{_n(t['bare_us'] / steps)} (mean) | | | "
                f"**{_r(_div(t['us'], t['vllm_us']))}** | {_r(_div(t['us'], t['bare_us']))} |")
    return "\n".join(head + rows)


def kinds(doc: dict[str, Any]) -> str:
    """Request-path medians by step kind: steps where a request joins, leaves, is
    preempted or resumes (join/leave) against the others (same batch)."""
    head = ["| stream | join/leave steps | median µs | ÷ vLLM | ÷ bare | same-batch steps | "
            "median µs | ÷ vLLM | ÷ bare |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = []
    for name, w in streams(doc):
        cells = []
        for kind in ("join_leave", "same_batch"):
            k = w[kind]
            if not k["steps"]:
                cells.append("0 | – | – | –")
                continue
            cells.append(f"{k['steps']} | {_n(k['median_us'])} | {_r(_median(k))} | "
                         f"{_r(_median(k, 'bare'))}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(head + rows)


def floor(doc: dict[str, Any]) -> str:
    """Request-path medians against the Python floor: the step's SchedulerOutput built
    in Python from its own lists (``vllm_replay.rebuilt_in_python``), what a Python rank
    does at least; empty for documents without it."""
    rows = []
    for name, w in streams(doc):
        p = w["request"]
        if "median_floor_us" not in p or not p["steps"]:
            continue
        rows.append(f"| {name} | {_n(p['median_floor_us'])} | "
                    f"{_r(_div(p['median_floor_us'], p['median_bare_us']))} | "
                    f"{_r(_div(p['floor_us'], p['bare_us']))} | "
                    f"{_r(_div(p['median_us'], p['median_floor_us']))} |")
    t = doc["total"]["request"]
    if rows and "floor_us" in t:
        rows.append(f"| **all recorded** | | | **{_r(_div(t['floor_us'], t['bare_us']))}** | "
                    f"{_r(_div(t['us'], t['floor_us']))} (summed) |")
    return "\n".join(["| stream | floor median µs | floor ÷ bare (median) | "
                      "floor ÷ bare (summed) | ours ÷ floor (median) |",
                      "| --- | ---: | ---: | ---: | ---: |", *rows]) if rows else ""


def fields(doc: dict[str, Any], shown: int = FIELDS_SHOWN) -> str:
    """Per stream, its largest request-path wire fields (exact bytes, summed over it)."""
    rows = []
    for name, w in streams(doc):
        f = w.get("request_fields") or {}
        total = sum(f.values())
        if not total:
            continue
        top = sorted(f.items(), key=lambda kv: -kv[1])[:shown]
        rows.append(f"| {name} | {_n(total / max(1, w['steps']))} | "
                    + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top) + " |")
    return "\n".join(["| stream | B/step | largest request-path fields (share of our bytes) |",
                      "| --- | ---: | --- |", *rows])


# ---------------------------------------------------------------- targets
def _verdict(name: str, value: float | None, bare: float | None, limit: str,
             met: bool | None, minimal: tuple[float | None, float | None] = (None, None),
             ) -> dict[str, Any]:
    """One target: ``value`` against vLLM's serializer, ``bare`` the same against bare
    pickle and ``minimal`` the minimal stateful channel's without and with a state digest
    against vLLM's serializer (all reported); ``met`` None: a figure reported beside the
    targets."""
    return {"target": name, "value": None if value is None else round(value, 3),
            "bare": None if bare is None else round(bare, 3),
            **{k: None if v is None else round(v, 3)
               for k, v in zip(("minimal", "digested"), minimal, strict=True)},
            "limit": limit,
            "met": None if met is None or value is None else bool(met)}


def minimal_ratios(p: dict[str, Any], summed: bool = False,
                   ) -> tuple[float | None, float | None]:
    """The minimal stateful channel's median step (``summed``: its sum over ``p``, a
    document's totals) ÷ vLLM's serializer's, without and with a state digest (None:
    not measured)."""
    at = "" if summed else "median_"

    def ratio(path: str) -> float | None:
        key = f"{at}{path}_us"
        if key not in p or not (summed or p["steps"]):
            return None
        return _div(p[key], p[f"{at}vllm_us"])

    return ratio("minimal"), ratio("digested")


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 35's targets, judged on ``doc`` against vLLM's serializer (ratios against
    bare pickle beside them); the same-batch steps' figures are the table's column."""
    out = []
    every = streams(doc)
    for name, w in every:
        if name.startswith(f"synthetic-{CHURN}"):
            continue
        r = _median(w["request"])
        out.append(_verdict(f"{name}: median µs ÷ vLLM", r, _median(w["request"], "bare"),
                            f"≤ {MEDIAN_LIMIT:g}", r is not None and r <= MEDIAN_LIMIT,
                            minimal_ratios(w["request"])))
    for name, w in doc["workloads"].items():
        k = w["join_leave"]
        if k["steps"]:
            r = _median(k)
            out.append(_verdict(f"{name}: join/leave steps' median µs ÷ vLLM ({k['steps']} "
                                f"steps)", r, _median(k, "bare"), f"≤ {JOIN_LIMIT:g}",
                                r is not None and r <= JOIN_LIMIT, minimal_ratios(k)))
    t = doc["total"]["request"]
    r = _div(t["us"], t["vllm_us"])
    out.append(_verdict("all recorded: summed µs ÷ vLLM", r, _div(t["us"], t["bare_us"]),
                        f"≤ {SUMMED_LIMIT:g}", r is not None and r <= SUMMED_LIMIT,
                        minimal_ratios(t, summed=True)))
    for name, w in every:
        if name.startswith(f"synthetic-{CHURN}"):
            r = _median(w["request"])
            out.append(_verdict(f"{name}: median µs ÷ vLLM", r, _median(w["request"], "bare"),
                                f"≤ {MEDIAN_LIMIT:g}", r is not None and r <= MEDIAN_LIMIT,
                                minimal_ratios(w["request"])))
    x = _div(t["vllm_bytes"], t["bytes"])
    out.append(_verdict("all recorded: × fewer request bytes", x, None,
                        f"≥ {BYTES_TARGET:g}×", x is not None and x >= BYTES_TARGET))
    return out


def _status(met: bool | None) -> str:
    return "reported" if met is None else "met" if met else "**not met**"


def _value(v: float | None) -> str:
    return "–" if v is None else f"{v:g}"


def render(doc: dict[str, Any]) -> str:
    meta = doc.get("meta", {})
    verdicts = ["| target | value (÷ vLLM) | ÷ bare pickle | minimal ÷ vLLM | "
                "minimal + digest ÷ vLLM | limit | |",
                "| --- | ---: | ---: | ---: | ---: | ---: | --- |"] + [
        f"| {t['target']} | {_value(t['value'])} | {_value(t['bare'])} | "
        f"{_value(t.get('minimal'))} | {_value(t.get('digested'))} | {t['limit']} | "
        f"{_status(t['met'])} |" for t in targets(doc)]
    kernels = {True: "C kernels", False: "pure Python kernels"}.get(meta.get("kernels"), "?")
    checked = [w["check"] for _, w in streams(doc) if "check" in w]
    parts = [f"Run {meta.get('date', '?')} at commit `{meta.get('commit', '?')}` "
             f"(load average {meta.get('load', 0):.1f}; {kernels}; vLLM "
             f"{meta.get('vllm') or '?'}; each step's µs the median of "
             f"{meta.get('passes', 1)} replays).  vLLM = its MessageQueue serializer of the "
             "same message; bare = bare pickle.dumps + loads.  µs = encode + decode per step.",
             "Request path (execute_model + sample_tokens):", table(doc, "request"),
             "Request path by step kind (medians):", kinds(doc),
             "Reply path (the two ModelRunnerOutput replies):", table(doc, "reply"),
             "Targets:", "\n".join(verdicts),
             *(("The Python floor: the step's SchedulerOutput built in Python from its own "
                "lists, fresh containers, nothing decoded (request path):", below)
               if (below := floor(doc)) else ()),
             "Where our request bytes go:", fields(doc)]
    if checked:
        found = sum(c["differences"] for c in checked)
        records = sum(c["records"] for c in checked)
        parts.append(f"Exactness: {records:,} messages decoded and compared with the "
                     f"originals in {len(checked)} streams: {found} differences.")
    return "\n\n".join(parts) + "\n"
