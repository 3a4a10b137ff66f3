"""The converter of the injected-kills benchmark's output
(:mod:`engine_side.bench.vllm_restarts`) into a figures table (for
:mod:`engine_side.bench.page_tables`)."""

from __future__ import annotations

from typing import Any

PHASES = (("detect_s", "detection (kill → noticed)"), ("stop_s", "stop the group"),
          ("spawn_s", "start the rank processes"), ("load_s", "device and weights"),
          ("build_s", "KV set-up and warm-up"), ("recompute_s", "recompute (→ next token)"),
          ("next_token_s", "kill → next token"))


def _s(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def from_restarts(doc: dict[str, Any]) -> dict[str, Any]:
    """``python -m engine_side.bench.vllm_restarts`` document → one line per phase."""
    s = doc["summary"]
    rows = [[label, _s(s[key]["median"]), _s(s[key]["max"])] for key, label in PHASES]
    lost = doc["requests"] - doc["complete"]
    targets = [
        {"target": f"requests lost across {doc['kills']} injected kills", "value": lost,
         "limit": "0", "met": lost == 0 and doc["kills"] >= 50},
        {"target": "detection, seconds (max)", "value": _s(s["detect_s"]["max"]),
         "limit": "≤ 1", "met": s["detect_s"]["max"] is not None
         and s["detect_s"]["max"] <= 1},
        {"target": "requests with the undisturbed run's token ids", "value":
         f"{doc['same_ids']} of {doc['requests']}", "limit": "reported", "met": None}]
    notes = [f"{doc['requests']} greedy requests (prompts of 40-104 tokens sharing a 32-token "
             f"prefix, 24 or 48 tokens each), two arriving every {doc['every']} steps, prefix "
             "caching and chunked prefill on; TP=2, engine core in-process, driven by "
             "LLMEngine.step; a rank SIGKILLed at seeded random steps, ranks alternating.",
             f"{doc['restarts']} restarts for {doc['kills']} kills; "
             f"{doc['complete']} of {doc['requests']} requests finished with all their "
             f"tokens; {doc['steps']} steps against {doc['base_steps']} undisturbed.",
             "Token ids: compared with vLLM's default executor running the same arrivals "
             "undisturbed; a recompute runs prefill kernels over tokens that were decoded "
             "and a restart changes which requests share a batch, so a greedy tie may "
             "break the other way."]
    if doc.get("failure"):
        notes.append(f"The executor failed: {doc['failure']}")
    return {"name": "vllm_restarts",
            "title": "A rank dies, no request is lost: DeltaExecutor under injected kills",
            "what": "LLM at TP=2 with requests arriving over time while a rank is SIGKILLed "
                    "again and again: requests lost, token ids against an undisturbed run, "
                    "and the seconds from each kill to the next token, by phase (median and "
                    "max over kills).",
            "columns": ["phase", "median s", "max s"], "rows": rows, "targets": targets,
            "notes": notes, "raw": doc}
