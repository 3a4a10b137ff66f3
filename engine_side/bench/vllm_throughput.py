"""End-to-end generation throughput: DeltaExecutor vs vLLM's default executor (CPU, TP=2).

::

    python -m engine_side.bench.vllm_throughput --rounds 2 --running 0,16 --json tp.json

Workloads (``--running``): 0 admits every prompt at the first step and gives each the
same ``--max-tokens`` (a batch: they all leave at the last step); N caps the running
requests at N (vLLM's ``max_num_seqs``) and draws each request's output length from
0.5-1.5 × ``--max-tokens``, so as requests finish the waiting ones join: continuous
batching, a join and a leave every ``max_tokens / N`` steps on average.

Each round runs, per workload, the default executor and then DeltaExecutor (A B A B
...), each in a fresh process (an ``LLM`` cannot be rebuilt cheaply in-process) with the
same prompts and engine options: the tiny random model (built if missing),
enforce_eager, block size 32, no prefix caching (every timed batch does the same work).
A process warms up with a small batch, then times ``LLM.generate`` of all the prompts
``--repeats`` times and reports output tokens/s.  Greedy and seeded requests, so every
run of a workload must produce the same token ids; the parent checks that.  The box is
shared, so compare the ratio within a round, not absolute tokens/s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from engine_side.bench.figures import stamp
from engine_side.bench.page_tables import write_figures
from engine_side.bench.vllm_scenarios import (
    add_run_options,
    build_tiny_model,
    listed,
    run_child,
    text,
    tree_cpu,
)
from protocol.cli_support import int_in

DEFAULT_MODEL = Path("/tmp/deltacast-tiny-llama")
EXECUTORS = ("default", "delta")


def _requests(count: int, max_tokens: int, varied: bool) -> tuple[list[str], list[Any]]:
    """Short prompts; three in four greedy, one in four seeded top-p (outputs comparable);
    ``varied``: output lengths drawn from 0.5-1.5 × ``max_tokens``, else all ``max_tokens``."""
    from vllm import SamplingParams

    rng = random.Random(11)
    prompts = [text(rng, 16, 48) for _ in range(count)]
    lengths = [rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2) if varied
               else max_tokens for _ in range(count)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=n,
                             ignore_eos=True) if i % 4 == 3 else
              SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(lengths)]
    return prompts, params


def child(args: argparse.Namespace) -> int:
    """One engine in this process: warm up, time ``--repeats`` generates, write JSON."""
    from vllm import LLM

    kw: dict[str, Any] = {}
    if args.executor == "delta":
        from engine_side.vllm import DeltaExecutor

        kw["distributed_executor_backend"] = DeltaExecutor
    running = args.running[0]  # (a child runs one workload)
    if running:
        kw["max_num_seqs"] = running
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, enforce_eager=True,
              block_size=32, max_model_len=512, seed=0, enable_prefix_caching=False, **kw)
    prompts, params = _requests(args.prompts, args.max_tokens, varied=bool(running))
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    runs, digest = [], ""
    for _ in range(args.repeats):
        c0, t0 = tree_cpu(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - t0, tree_cpu() - c0
        tokens = [list(c.token_ids) for o in outs for c in o.outputs]
        runs.append({"seconds": elapsed, "tokens": sum(map(len, tokens)), "cpu_s": cpu,
                     "tok_s": sum(map(len, tokens)) / elapsed})
        digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    Path(args.child_out).write_text(json.dumps({"executor": args.executor, "runs": runs,
                                                "digest": digest}))
    return 0


def _spawn(args: argparse.Namespace, running: int, executor: str, out: Path,
           ) -> dict[str, Any]:
    argv = ["--executor", executor, "--child-out", str(out), "--model", args.model,
            "--tp", str(args.tp), "--prompts", str(args.prompts), "--running", str(running),
            "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if args.tp == 2 else "auto"}
    return run_child("engine_side.bench.vllm_throughput", argv, out, f"{executor} run", bind)


def rounds(args: argparse.Namespace) -> dict[str, Any]:
    """A B A B ...: per round and workload the median tokens/s of each executor and their
    ratio; a workload's outputs are identical when every run gave the same token ids."""
    tmp = Path(args.work_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    workloads = [{"running": n, "rounds": [], "digests": set()} for n in args.running]
    for r in range(1, args.rounds + 1):
        for w in workloads:
            row: dict[str, Any] = {"round": r}
            for executor in EXECUTORS:
                res = _spawn(args, w["running"], executor,
                             tmp / f"{executor}-{w['running']}-{r}.json")
                row[executor] = statistics.median(x["tok_s"] for x in res["runs"])
                row[f"{executor}_cpu_ms_per_token"] = statistics.median(
                    1e3 * x["cpu_s"] / x["tokens"] for x in res["runs"])
                row[f"{executor}_runs"] = res["runs"]
                w["digests"].add(res["digest"])
                each = ", ".join(f"{x['tok_s']:.0f}" for x in res["runs"])
                print(f"round {r} running {w['running'] or 'all'} {executor}: "
                      f"{row[executor]:.0f} output tokens/s ({each})", file=sys.stderr,
                      flush=True)
            row["ratio"] = row["delta"] / row["default"]
            w["rounds"].append(row)
    for w in workloads:
        w["outputs_identical"] = len(w.pop("digests")) == 1
        w["median_ratio"] = statistics.median(r["ratio"] for r in w["rounds"])
    return {"tp": args.tp, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "workloads": workloads,
            "outputs_identical": all(w["outputs_identical"] for w in workloads)}


def render(doc: dict[str, Any]) -> str:
    lines = ["| running | round | default tok/s | DeltaExecutor tok/s | Delta ÷ default | "
             "CPU ms/token default | CPU ms/token Delta |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w in doc["workloads"]:
        lines += [f"| {w['running'] or 'all'} | {r['round']} | {r['default']:,.0f} | "
                  f"{r['delta']:,.0f} | {r['ratio']:.3f} | "
                  f"{r['default_cpu_ms_per_token']:.2f} | {r['delta_cpu_ms_per_token']:.2f} |"
                  for r in w["rounds"]]
    lines += [f"\nRunning {w['running'] or 'all'}: median ratio {w['median_ratio']:.3f}; "
              f"outputs identical across its runs: "
              f"{'yes' if w['outputs_identical'] else '**no**'}." for w in doc["workloads"]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="tiny model dir (built if missing)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--running", type=listed(int_in(0, 1024)), default=[0, 16, 64],
                   metavar="N,N,...",
                   help="workloads: 0 admits every prompt at once with one output length "
                        "(a batch); N caps the running requests at N with output lengths "
                        "0.5-1.5x --max-tokens, so requests join as others leave "
                        "(default 0,16,64)")
    p.add_argument("--repeats", type=int, default=2, help="timed generates per process")
    p.add_argument("--rounds", type=int, default=2)
    add_run_options(p, "throughput", EXECUTORS)
    args = p.parse_args()
    if args.executor:
        return child(args)
    started = stamp() if args.figures else None  # for the figures envelope
    build_tiny_model(Path(args.model))
    doc = rounds(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(render(doc))
    if args.figures and doc["outputs_identical"]:  # the envelope BENCHMARKS.md is made from
        write_figures(args.figures, "vllm_throughput", doc, started)
    return 0 if doc["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
