"""Benchmark: serving latency with requests arriving over time, DeltaExecutor against
vLLM's default executor (CPU, TP=2).

::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m engine_side.bench.vllm_serving \\
        --rounds 5 --rate 40,120 --figures docs/benchmarks/vllm_serving.json

What a server's users see of the channel: requests arrive by a seeded Poisson process
for ``--seconds`` (at each ``--rate`` per second in turn; prompts of 16-112 token ids,
output lengths 0.5-1.5 × ``--max-tokens``, greedy), and an engine loop adds each one
when its time comes and
steps ``LLMEngine`` as a server's loop does, so requests join and leave every few steps
at whatever batch the load makes.  Per request: time to first token (from its arrival)
and the gaps between its later tokens (inter-token latency); per run: output tokens/s
over the run and CPU ms per output token of the process tree.  Each run is a fresh
process (an ``LLM`` cannot be rebuilt cheaply in-process) with the same arrivals; rounds
alternate the executors (A B A B ...).  Arrivals follow the wall clock, so which
requests share a step differs from run to run and token ids are not compared (the
throughput benchmark compares them); every request must finish with all its tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from engine_side.bench.vllm_scenarios import (
    add_run_options,
    build_tiny_model,
    listed,
    percentile,
    run_child,
    tree_cpu,
)
from protocol.cli_support import float_in, int_in

DEFAULT_MODEL = Path("/tmp/deltacast-tiny-llama")
EXECUTORS = ("default", "delta")


def arrivals(count: int, rate: float, max_tokens: int, seed: int = 7,
             ) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt token ids, max tokens) per request, in arrival order."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        prompt = [rng.randrange(20, 400) for _ in range(rng.randint(16, 112))]
        out.append((at, prompt, rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2)))
    return out


def latencies(arrived: dict[str, float], token_times: dict[str, list[float]],
              ) -> tuple[list[float], list[float]]:
    """(time to first token of each request, every gap between a request's consecutive
    tokens), in seconds, from arrival times and each token's time."""
    ttft, itl = [], []
    for rid, times in token_times.items():
        if times:
            ttft.append(times[0] - arrived[rid])
            itl += [b - a for a, b in zip(times, times[1:], strict=False)]
    return ttft, itl


def serve(llm: Any, plan: list[tuple[float, list[int], int]]) -> dict[str, Any]:
    """Add each request of ``plan`` at its time and step the engine until all finish."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    arrived: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    finished, k, steps = 0, 0, 0
    c0, start = tree_cpu(), time.perf_counter()
    while finished < len(plan):
        now = time.perf_counter() - start
        while k < len(plan) and plan[k][0] <= now:
            at, prompt, n = plan[k]
            rid = str(k)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            arrived[rid], times[rid], counts[rid] = start + at, [], 0
            k += 1
        if not engine.has_unfinished_requests():
            if k >= len(plan):
                raise RuntimeError(f"{len(plan) - finished} requests never finished")
            time.sleep(min(0.001, max(0.0, plan[k][0] - now)))  # idle until the next
            continue
        outs = engine.step()
        steps += 1
        t = time.perf_counter()
        for out in outs:
            got = len(out.outputs[0].token_ids)
            times[out.request_id] += [t] * (got - counts[out.request_id])
            counts[out.request_id] = got
            finished += out.finished
    elapsed, cpu = time.perf_counter() - start, tree_cpu() - c0
    ttft, itl = latencies(arrived, times)
    tokens = sum(counts.values())
    return {"seconds": elapsed, "steps": steps, "tokens": tokens, "tok_s": tokens / elapsed,
            "cpu_ms_per_token": 1e3 * cpu / tokens,
            "complete": sum(counts[str(i)] == n for i, (_, _, n) in enumerate(plan)),
            "ttft_ms": {"p50": 1e3 * percentile(ttft, 50), "p99": 1e3 * percentile(ttft, 99)},
            "itl_ms": {"p50": 1e3 * percentile(itl, 50), "p99": 1e3 * percentile(itl, 99)}}


def child(args: argparse.Namespace) -> int:
    """One engine in this process: warm up, serve the arrivals, write JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if args.executor == "delta":
        from engine_side.vllm import DeltaExecutor

        kw["distributed_executor_backend"] = DeltaExecutor
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, enforce_eager=True,
              block_size=32, max_model_len=512, seed=0, enable_prefix_caching=False,
              max_num_seqs=args.max_running, **kw)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(20, 52)))] * 8,
                 SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    result = serve(llm, arrivals(args.requests, args.rate[0], args.max_tokens))
    Path(args.child_out).write_text(json.dumps({"executor": args.executor, **result}))
    return 0


def _run(args: argparse.Namespace, rate: float, requests: int, executor: str,
         out: Path) -> dict[str, Any]:
    argv = ["--executor", executor, "--child-out", str(out), "--model", args.model,
            "--tp", str(args.tp), "--rate", f"{rate:g}", "--requests", str(requests),
            "--max-tokens", str(args.max_tokens), "--max-running", str(args.max_running)]
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if args.tp == 2 else "auto"}
    res = run_child("engine_side.bench.vllm_serving", argv, out, f"{executor} run", bind)
    print(f"rate {rate:g} {executor}: ITL p50 {res['itl_ms']['p50']:.2f} ms, p99 "
          f"{res['itl_ms']['p99']:.2f}; TTFT p50 {res['ttft_ms']['p50']:.1f} ms; "
          f"{res['tok_s']:.0f} tok/s; {res['steps']} steps", file=sys.stderr, flush=True)
    return res


def rounds(args: argparse.Namespace) -> dict[str, Any]:
    """A B A B ...: per round and load, the runs of both executors and their ratios."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    loads = [{"rate": rate, "requests": max(1, round(rate * args.seconds)), "rounds": []}
             for rate in args.rate]
    for r in range(1, args.rounds + 1):
        for load in loads:
            row: dict[str, Any] = {"round": r}
            for executor in EXECUTORS:
                row[executor] = _run(args, load["rate"], load["requests"], executor,
                                     work / f"{executor}-{load['rate']:g}-{r}.json")
            row["ratios"] = ratios(row["delta"], row["default"])
            load["rounds"].append(row)
    for load in loads:
        finish(load)
    return {"tp": args.tp, "seconds": args.seconds, "max_tokens": args.max_tokens,
            "max_running": args.max_running, "loads": loads,
            "complete": all(load["complete"] for load in loads)}


def ratios(delta: dict[str, Any], default: dict[str, Any]) -> dict[str, float]:
    """Delta ÷ default of one round's two runs (latencies: lower is better)."""
    return {"itl_p50": delta["itl_ms"]["p50"] / default["itl_ms"]["p50"],
            "itl_p99": delta["itl_ms"]["p99"] / default["itl_ms"]["p99"],
            "ttft_p50": delta["ttft_ms"]["p50"] / default["ttft_ms"]["p50"],
            "tok_s": delta["tok_s"] / default["tok_s"]}


def finish(load: dict[str, Any]) -> None:
    """A load's rounds (each with ``default``, ``delta`` and ``ratios``) summed up:
    whether every run finished every request, and the median of each ratio."""
    rows = load["rounds"]
    load["complete"] = all(row[e]["complete"] == load["requests"]
                           for row in rows for e in EXECUTORS)
    load["median_ratios"] = {k: statistics.median(row["ratios"][k] for row in rows)
                             for k in rows[0]["ratios"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="tiny model dir (built if missing)")
    p.add_argument("--tp", type=int_in(1), default=2)
    p.add_argument("--rate", type=listed(float_in(0, exclusive=True)), default=[40.0, 120.0],
                   metavar="R,R,...",
                   help="loads: mean arrivals per second (Poisson), each in turn "
                        "(default 40,120)")
    p.add_argument("--seconds", type=float_in(0, exclusive=True), default=6.0,
                   help="arrivals over this long at each rate")
    p.add_argument("--requests", type=int_in(1), help=argparse.SUPPRESS)  # (a child)
    p.add_argument("--max-tokens", type=int_in(1), default=64,
                   help="mean output length (each drawn from 0.5-1.5x this)")
    p.add_argument("--max-running", type=int_in(1), default=256,
                   help="vLLM's max_num_seqs")
    p.add_argument("--rounds", type=int_in(1), default=5)
    add_run_options(p, "serving", EXECUTORS)
    args = p.parse_args(argv)
    if args.executor:
        return child(args)
    from engine_side.bench import figures
    from engine_side.bench.page_tables import write_figures

    started = figures.stamp() if args.figures else None
    build_tiny_model(Path(args.model))
    doc = rounds(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(json.dumps({f"{load['rate']:g}/s": load["median_ratios"] for load in doc["loads"]},
                     indent=1))
    if args.figures and doc["complete"]:
        write_figures(args.figures, "vllm_serving", doc, started)
    return 0 if doc["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
