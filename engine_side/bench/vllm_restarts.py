"""Benchmark: a rank dies, no request is lost -- DeltaExecutor under injected kills.

::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m engine_side.bench.vllm_restarts \\
        --kills 50 --freezes 10 --soak-s 600 --figures docs/benchmarks/vllm_restarts.json

A real vLLM (CPU) at TP=2 on a tiny random Llama, requests arriving over time (two every
few steps, greedy, fixed lengths, prefix-sharing prompts), driven step by step through
``LLMEngine.step``.  First vLLM's default executor runs the workload undisturbed, then
DeltaExecutor with a rank SIGKILLed at seeded random steps (ranks alternating; during
prefill and decode alike), and at ``--freezes`` more steps SIGSTOPped instead (frozen:
killed past the liveness bound).  Per fault: seconds from it until the executor noticed
(detection), its restart split into stopping the group, starting the rank processes,
their device and weights, and the replayed KV set-up and warm-up; then the recompute,
until the next token of a request that was running at the fault.  Per request: did it
finish with all its tokens, and are its token ids the undisturbed run's.  Last, a soak:
DeltaExecutor runs the workload again and again without faults for ``--soak-s``
seconds, and every restart there is a false kill by the liveness bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

PROMPT_TOKENS = (40, 72, 104)  # prompt lengths, cycled (a shared 32-token prefix each)
MAX_TOKENS = (24, 48)


def _engine(model: Path, delta: bool, restarts: int) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if delta:
        from engine_side.vllm import DeltaExecutor

        kw = {"distributed_executor_backend": DeltaExecutor,
              "additional_config": {"deltacast_restarts": restarts,
                                    "deltacast_restart_window_s": 3600}}
    return LLM(model=str(model), tensor_parallel_size=2, enforce_eager=True, block_size=32,
               max_model_len=512, seed=0, enable_prefix_caching=True,
               max_num_batched_tokens=256, enable_chunked_prefill=True, **kw)


def _requests(n: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max tokens) of request k: a shared prefix, then its own."""
    return [([5 + (j % 11) for j in range(32)] +
             [(31 * k + 7 * j) % 400 + 20 for j in range(PROMPT_TOKENS[k % 3] - 32)],
             MAX_TOKENS[k % 2]) for k in range(n)]


def drive(llm: Any, requests: list[tuple[list[int], int]], every: int,
          faults: dict[int, tuple[int, str]]) -> dict[str, Any]:
    """Add two requests every ``every`` steps; at step s in ``faults`` SIGKILL (``kill``)
    or SIGSTOP (``freeze``) that rank.  Returns each request's token ids and, per fault,
    when it happened and when each request running then got its next token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    ids: dict[str, list[int]] = {}
    running: set[str] = set()
    events: list[dict[str, Any]] = []
    waiting_next: dict[str, int] = {}  # request -> the kill whose next token it owes
    step, added = 0, 0
    while added < len(requests) or engine.has_unfinished_requests():
        if step % every == 0:
            for _ in range(2):
                if added < len(requests):
                    prompt, n = requests[added]
                    engine.add_request(str(added), TokensPrompt(prompt_token_ids=prompt),
                                       SamplingParams(temperature=0, max_tokens=n,
                                                      ignore_eos=True))
                    ids[str(added)] = []
                    added += 1
        if step in faults:
            ex = engine.engine_core.engine_core.model_executor
            rank, kind = faults[step]
            proc = ex.local.procs[rank]
            at = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            if kind == "kill":
                wait([proc.sentinel], 10)
            events.append({"step": step, "rank": rank, "kind": kind, "at": at,
                           "running": len(running), "next_token_s": None})
            waiting_next.update(dict.fromkeys(running, len(events) - 1))
        for out in engine.step():
            got = list(out.outputs[0].token_ids)
            if len(got) > len(ids[out.request_id]):
                k = waiting_next.pop(out.request_id, None)
                if k is not None and events[k]["next_token_s"] is None:
                    events[k]["next_token_s"] = time.monotonic() - events[k]["at"]
            ids[out.request_id] = got
            (running.discard if out.finished else running.add)(out.request_id)
        step += 1
    return {"ids": ids, "events": events, "steps": step}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from engine_side.bench.vllm_scenarios import build_tiny_model

    model = build_tiny_model(work / "tiny-llama")
    requests = _requests(args.requests)
    llm = _engine(model, False, 0)
    base = drive(llm, requests, args.every, {})
    llm.llm_engine.engine_core.shutdown()
    del llm
    rng = random.Random(args.seed)
    steps = sorted(rng.sample(range(3, base["steps"] - 3), args.kills + args.freezes))
    frozen = set(rng.sample(steps, args.freezes))
    faults = {s: (k % 2, "freeze" if s in frozen else "kill") for k, s in enumerate(steps)}
    llm = _engine(model, True, len(faults))
    ex = llm.llm_engine.engine_core.engine_core.model_executor
    got = drive(llm, requests, args.every, faults)
    recoveries = list(ex.recoveries)
    failure = ex.failure
    llm.llm_engine.engine_core.shutdown()
    for event, rec in zip(got["events"], recoveries, strict=False):
        event.update({"detect_s": rec["noticed_at"] - event["at"], "stop_s": rec["stop"],
                      "spawn_s": rec["spawn"], "load_s": rec["load"],
                      "build_s": rec["build"], "cause": rec["cause"]})
        if event["next_token_s"] is not None:
            event["recompute_s"] = event["next_token_s"] - event["detect_s"] - rec["total"]
    want = {r: len(base["ids"][r]) for r in base["ids"]}
    return {"requests": len(requests), "every": args.every, "kills": args.kills,
            "freezes": args.freezes, "restarts": len(recoveries), "failure": failure,
            "events": got["events"],
            "complete": sum(len(got["ids"].get(r, [])) == n for r, n in want.items()),
            "same_ids": sum(got["ids"].get(r) == base["ids"][r] for r in want),
            "max_tokens": {str(n) for n in MAX_TOKENS}, "steps": got["steps"],
            "base_steps": base["steps"], "liveness_s": ex.liveness_s,
            "soak": soak(model, requests, args, base) if args.soak_s > 0 else None}


def soak(model: Path, requests: list[tuple[list[int], int]], args: argparse.Namespace,
         base: dict[str, Any]) -> dict[str, Any]:
    """DeltaExecutor without faults, the workload again and again for ``soak_s``:
    restarts there are false kills (the liveness bound, on a box its ranks keep busy)."""
    llm = _engine(model, True, 100)
    ex = llm.llm_engine.engine_core.engine_core.model_executor
    start, rounds, steps, same = time.monotonic(), 0, 0, 0
    while time.monotonic() - start < args.soak_s:
        got = drive(llm, requests, args.every, {})
        rounds, steps = rounds + 1, steps + got["steps"]
        same += sum(got["ids"].get(r) == ids for r, ids in base["ids"].items())
    seconds = time.monotonic() - start
    out = {"seconds": round(seconds), "rounds": rounds, "steps": steps,
           "requests": rounds * len(requests), "same_ids": same,
           "false_kills": len(ex.recoveries), "causes": [r["cause"] for r in ex.recoveries],
           "failure": ex.failure}
    llm.llm_engine.engine_core.shutdown()
    return out


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Median and max per phase over the faults, and detection per kind of fault."""
    def stats(vals: list[float]) -> dict[str, float | None]:
        return {"median": statistics.median(vals) if vals else None,
                "max": max(vals) if vals else None}

    events = doc["events"]
    out = {k: stats([e[k] for e in events if e.get(k) is not None]) for k in
           ("detect_s", "stop_s", "spawn_s", "load_s", "build_s", "recompute_s",
            "next_token_s")}
    for kind in ("kill", "freeze"):
        out[f"detect_{kind}_s"] = stats([e["detect_s"] for e in events if e.get(
            "kind", "kill") == kind and e.get("detect_s") is not None])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--freezes", type=int, default=10,
                   help="more faults: a rank SIGSTOPped (killed past the liveness bound)")
    p.add_argument("--soak-s", type=float, default=600,
                   help="then run without faults this long, counting false kills (0: no soak)")
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--every", type=int, default=3, help="steps between arrivals of two")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write the raw document here")
    p.add_argument("--figures", default="", metavar="FILE",
                   help="write the figures envelope BENCHMARKS.md is made from")
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the executor object is reachable
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from engine_side.bench import figures
    from engine_side.bench.page_tables import write_figures

    started = figures.stamp()
    with tempfile.TemporaryDirectory(prefix="deltacast-restarts-") as work:
        doc = run(args, Path(work))
    doc["max_tokens"] = sorted(doc["max_tokens"])
    doc["summary"] = summary(doc)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "events"}, indent=1))
    if args.figures:
        write_figures(args.figures, "vllm_restarts", doc, started)
    soaked = doc["soak"] is None or doc["soak"]["false_kills"] == 0
    return 0 if doc["complete"] == doc["requests"] and not doc["failure"] and soaked else 1


if __name__ == "__main__":
    sys.exit(main())
