"""Markdown tables and target verdicts of a ``vllm_streams`` replay document (JSON).

``render(doc)`` regenerates the BENCHMARKS "vLLM streams" tables from the JSON
that ``python -m engine_side.bench.vllm_streams --scenario all --json FILE``
writes; ``targets(doc)`` judges issue 4's targets on the same figures.  "pickle" is
the document's ``meta.baseline``: vLLM's own serializer of the message
(``vllm_replay.vllm_serialize``) unless the run chose bare ``pickle.dumps`` + ``loads``
(documents from before the twenty-fourth session have no such key: bare).
"""

from __future__ import annotations

from typing import Any

BYTES_TARGET, CHUNKED_TARGET, TOTAL_TARGET, REPLY_TARGET = 8.0, 6.0, 15.0, 10.0
STEADY_LIMIT = 32  # bytes per steady decode step, plus 4 per new block
#: our continuous-batching streams (a join and a finish every step): the worst case for a
#: stateful channel, reported beside issue 4's targets, which name the recorded workloads
#: and steady decode at 256 and 4096 requests
CHURN = "synthetic-churn-"


def _fewer(ours: float, theirs: float) -> float:
    return theirs / ours if ours else float("inf")


def _n(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"


def _x(v: float) -> str:
    return f"{v:.1f}×" if v < 100 else f"{v:,.0f}×"


def _rows(doc: dict[str, Any], path: str) -> list[str]:
    out = []
    streams = [(k, v) for k, v in doc["workloads"].items()] + \
        [(f"synthetic-{k}", v) for k, v in doc.get("synthetic", {}).items()]
    for name, w in streams:
        p, steps = w[path], max(1, w["steps"])
        out.append(f"| {name} | {w['steps']} | {_n(p['bytes'] / steps)} | "
                   f"{_n(p['pickle_bytes'] / steps)} | {_x(_fewer(p['bytes'], p['pickle_bytes']))}"
                   f" | {_n(p['median_us'])} | {_n(p['pickle_median_us'])} | "
                   f"{p['median_us'] / p['pickle_median_us']:.2f} |")
    t = doc["total"][path]
    steps = sum(w["steps"] for w in doc["workloads"].values())
    out.append(f"| **all recorded** | {steps} | {_n(t['bytes'] / steps)} | "
               f"{_n(t['pickle_bytes'] / steps)} | **{_x(_fewer(t['bytes'], t['pickle_bytes']))}**"
               f" | {_n(t['us'] / steps)} (mean) | {_n(t['pickle_us'] / steps)} (mean) | "
               f"{t['us'] / t['pickle_us']:.2f} |")
    return out


def table(doc: dict[str, Any], path: str) -> str:
    head = ["| stream | steps | B/step | pickle B/step | × fewer bytes | median µs/step | "
            "pickle median µs/step | µs ÷ pickle |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    return "\n".join(head + _rows(doc, path))


def kinds(doc: dict[str, Any]) -> str:
    """Request-path µs by step kind: steps where a request joins, leaves or resumes (the
    general path) against the others (same batch), means over the steps of each kind."""
    head = ["| stream | join/leave steps | mean µs | pickle mean µs | µs ÷ pickle | "
            "same-batch steps | mean µs | pickle mean µs | µs ÷ pickle |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows = []
    streams = [*doc["workloads"].items(),
               *((f"synthetic-{k}", v) for k, v in doc.get("synthetic", {}).items())]
    for name, w in streams:
        if "churn" not in w:
            continue  # a document written before step kinds were recorded
        cells = []
        for kind in ("churn", "same_batch"):
            k = w[kind]
            if not k["steps"]:
                cells.append("0 | – | – | –")
                continue
            cells.append(f"{k['steps']} | {_n(k['us'] / k['steps'])} | "
                         f"{_n(k['pickle_us'] / k['steps'])} | {k['us'] / k['pickle_us']:.2f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(head + rows)


def _verdict(name: str, value: float, limit: str, met: bool | None) -> dict[str, Any]:
    """One row of the targets; ``met`` None: a figure reported beside them, no target."""
    return {"target": name, "value": value, "limit": limit,
            "met": None if met is None else bool(met)}


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 4's stream targets, judged on ``doc``."""
    out = []
    for name, w in doc["workloads"].items():
        need = CHUNKED_TARGET if name == "chunked" else BYTES_TARGET
        x = _fewer(w["request"]["bytes"], w["request"]["pickle_bytes"])
        out.append(_verdict(f"{name}: × fewer request bytes", round(x, 1), f"≥ {need:g}×",
                            x >= need))
    t = doc["total"]["request"]
    x = _fewer(t["bytes"], t["pickle_bytes"])
    out.append(_verdict("all recorded: × fewer request bytes", round(x, 1),
                        f"≥ {TOTAL_TARGET:g}×", x >= TOTAL_TARGET))
    streams = {**doc["workloads"], **{f"synthetic-{k}": v for k, v in doc["synthetic"].items()}}
    for name, w in streams.items():
        worst = w["steady"]["max_over_blocks"]
        if worst is not None:
            st = w["steady"]
            out.append(_verdict(f"{name}: steady decode B − 4/new block (worst of "
                                f"{st['steps']}; {st.get('within_32', '?')} within)", worst,
                                f"≤ {STEADY_LIMIT}", worst <= STEADY_LIMIT))
    for name, w in streams.items():
        r = w["request"]["median_us"] / w["request"]["pickle_median_us"]
        if name.startswith(CHURN):  # ours, beyond the workloads: reported
            out.append(_verdict(f"{name}: median µs ÷ pickle (worst case, no target)",
                                round(r, 2), "–", None))
            continue
        limit = 0.5 if name in ("synthetic-256", "synthetic-4096") else 1.0
        out.append(_verdict(f"{name}: median µs ÷ pickle", round(r, 2), f"≤ {limit:g}",
                            r <= limit))
    for name, w in streams.items():
        full = w["reply_at_max_running"]
        if w["max_running"] == 256 and full["steps"]:
            x = _fewer(full["median_bytes"], full["pickle_median_bytes"])
            out.append(_verdict(f"{name}: × fewer reply bytes at 256 requests (median of "
                                f"{full['steps']} steps)", round(x, 1), f"≥ {REPLY_TARGET:g}×",
                                x >= REPLY_TARGET))
    return out


def _fields(doc: dict[str, Any]) -> list[str]:
    """Per workload, the three largest request-path fields (exact, summed over the run)."""
    out = []
    for name, w in doc["workloads"].items():
        fields = w.get("request_fields") or {}
        if not fields:
            continue
        total = sum(fields.values())
        top = sorted(fields.items(), key=lambda kv: -kv[1])[:4]
        out.append(f"| {name} | " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top)
                   + " |")
    return ["| workload | largest request-path fields (share of our bytes) |",
            "| --- | --- |", *out]


def _status(met: bool | None) -> str:
    return "reported" if met is None else "met" if met else "**not met**"


def render(doc: dict[str, Any]) -> str:
    meta = doc.get("meta", {})
    verdicts = ["| target | value | limit | |", "| --- | ---: | ---: | --- |"] + [
        f"| {t['target']} | {t['value']} | {t['limit']} | {_status(t['met'])} |"
        for t in targets(doc)]
    parts = [f"Run {meta.get('date', '?')} at commit `{meta.get('commit', '?')}` "
             f"(load average {meta.get('load', 0):.1f}; {meta.get('speedups', 'speedups ?')}"
             f"; pickle = {meta.get('baseline', 'bare pickle.dumps + loads')}).",
             "Request path (execute_model + sample_tokens):", table(doc, "request"),
             "Request path by step kind (means):", kinds(doc),
             "Reply path (the two ModelRunnerOutput replies):", table(doc, "reply"),
             "Targets:", "\n".join(verdicts),
             "Where our request bytes go:", "\n".join(_fields(doc))]
    return "\n\n".join(parts) + "\n"
