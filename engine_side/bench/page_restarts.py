"""The converter of the injected-kills benchmark's output
(:mod:`engine_side.bench.vllm_restarts`) into a figures table (for
:mod:`engine_side.bench.page_tables`)."""

from __future__ import annotations

from typing import Any

PHASES = (("detect_kill_s", "detection of a killed rank (kill → noticed)"),
          ("detect_freeze_s", "detection of a frozen rank (SIGSTOP → noticed)"),
          ("stop_s", "stop the group"),
          ("spawn_s", "start the rank processes"), ("load_s", "device and weights"),
          ("build_s", "KV set-up and warm-up"), ("recompute_s", "recompute (→ next token)"),
          ("next_token_s", "fault → next token"))


def _s(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def from_restarts(doc: dict[str, Any]) -> dict[str, Any]:
    """``python -m engine_side.bench.vllm_restarts`` document → one line per phase."""
    s = doc["summary"]
    rows = [[label, _s(s[key]["median"]), _s(s[key]["max"])] for key, label in PHASES
            if key in s]
    lost = doc["requests"] - doc["complete"]
    freezes = doc.get("freezes", 0)
    targets = [
        {"target": f"requests lost across {doc['kills']} kills and {freezes} freezes",
         "value": lost, "limit": "0", "met": lost == 0 and doc["kills"] >= 50},
        {"target": "detection, seconds (max)", "value": _s(s["detect_s"]["max"]),
         "limit": "≤ 1", "met": s["detect_s"]["max"] is not None
         and s["detect_s"]["max"] <= 1}]
    soak = doc.get("soak")
    if soak:
        targets.append({"target": f"false kills in a {soak['seconds'] / 60:.0f}-minute "
                                  f"no-fault soak ({soak['requests']} requests)",
                        "value": soak["false_kills"], "limit": "0",
                        "met": soak["false_kills"] == 0})
    targets += [
        {"target": "requests with the undisturbed run's token ids", "value":
         f"{doc['same_ids']} of {doc['requests']}", "limit": "reported", "met": None}]
    notes = [f"{doc['requests']} greedy requests (prompts of 40-104 tokens sharing a 32-token "
             f"prefix, 24 or 48 tokens each), two arriving every {doc['every']} steps, prefix "
             "caching and chunked prefill on; TP=2, engine core in-process, driven by "
             "LLMEngine.step; a rank SIGKILLed at seeded random steps, ranks alternating, "
             f"and SIGSTOPped at {freezes} more (liveness bound "
             f"{doc.get('liveness_s', 0.6):g} s).",
             f"{doc['restarts']} restarts for {doc['kills'] + freezes} faults; "
             f"{doc['complete']} of {doc['requests']} requests finished with all their "
             f"tokens; {doc['steps']} steps against {doc['base_steps']} undisturbed.",
             "Token ids: compared with vLLM's default executor running the same arrivals "
             "undisturbed; a recompute runs prefill kernels over tokens that were decoded "
             "and a restart changes which requests share a batch, so a greedy tie may "
             "break the other way."]
    if soak:
        notes.append(f"Soak: DeltaExecutor ran the workload {soak['rounds']} times "
                     f"({soak['steps']} steps, {soak['seconds']} s) without faults: "
                     f"{soak['false_kills']} restarts; {soak['same_ids']} of "
                     f"{soak['requests']} requests had the undisturbed token ids.")
    if doc.get("failure"):
        notes.append(f"The executor failed: {doc['failure']}")
    return {"name": "vllm_restarts",
            "title": "A rank dies, no request is lost: DeltaExecutor under injected kills",
            "what": "LLM at TP=2 with requests arriving over time while a rank is SIGKILLed "
                    "or frozen (SIGSTOP) again and again: requests lost, token ids against "
                    "an undisturbed run, the seconds from each fault to the next token, by "
                    "phase (median and max over faults), and false kills without faults.",
            "columns": ["phase", "median s", "max s"], "rows": rows, "targets": targets,
            "notes": notes, "raw": doc}
