"""Benchmark: TP=2 across two hosts, DeltaExecutor against vLLM's own multi-node mode.

::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m engine_side.bench.vllm_nodes --rounds 5 \\
        --figures docs/benchmarks/vllm_nodes.json

Two network namespaces joined by a veth pair shaped to 1 Gbit/s (:mod:`engine_side.bench.
netns`; needs root) stand for two hosts: the engine and rank 0 in A, rank 1 in B
(``deltacast node`` for DeltaExecutor; ``vllm serve --headless --nnodes 2 --node-rank 1``
for vLLM's multiprocessing executor, whose engine gets ``nnodes=2``).  Rounds alternate
the two: a warm-up generate, then a timed one; tokens/s, token ids, and the bytes that
crossed between the hosts on the engine process's sockets (the step channel: calls
and replies) and on the ranks' (collectives), read from the kernel's per-socket
counters (``ss``).  Then faults on DeltaExecutor mid-generation: rank 1 killed
(SIGKILL), frozen (SIGSTOP), its link cut (``ip link set down``), with
``deltacast_restarts`` 0 (the group fails rather than restarts): seconds from the fault
until ``LLM.generate`` raised.

``--serving-rate R --figures docs/benchmarks/vllm_nodes_serving.json`` runs instead
requests arriving over time at R a second, as :mod:`engine_side.bench.vllm_serving`
serves them, to both backends in alternating rounds: inter-token latency, time to first
token and tokens/s across the two hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_side.bench import netns

ROOT = Path(__file__).resolve().parents[2]
PORT = 29611  # each namespace has its own ports
FAULTS = ("kill", "stop", "link")
LINK = "veth, tbf 1 Gbit/s (no netem here: no added delay)"
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
       "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _vllm_args(model: Path) -> dict[str, Any]:
    return {"model": str(model), "tensor_parallel_size": 2, "enforce_eager": True,
            "max_model_len": 256, "seed": 0}


def cli_args(args: dict[str, Any]) -> list[str]:
    """LLM keyword arguments as vLLM's command line (the model first)."""
    args = dict(args)
    out = [str(args.pop("model"))]
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [
            flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def commands(backend: str, a: netns.Host, model: Path, keys: Path, restarts: bool = True,
             ) -> tuple[dict[str, Any], list[str]]:
    """(the engine's LLM arguments, node 1's command line) for ``backend``; without
    ``restarts``, a dead rank fails DeltaExecutor instead of restarting its group."""
    llm = _vllm_args(model)
    if backend == "delta":
        llm["distributed_executor_backend"] = "engine_side.vllm.DeltaExecutor"
        llm["additional_config"] = {"deltacast_nnodes": 2, "deltacast_master_addr": a.addr,
                                    "deltacast_master_port": PORT, "deltacast_keys": str(keys),
                                    **({} if restarts else {"deltacast_restarts": 0})}
        node = [sys.executable, "-m", "engine_side.cli", "node", "--nnodes", "2",
                "--node-rank", "1", "--master-addr", a.addr, "--master-port", str(PORT),
                "--keys", str(keys), "--engine", "llm", *cli_args(llm)]
        return llm, node
    layout = {"nnodes": 2, "master_addr": a.addr, "master_port": PORT}
    node = [sys.executable, str(ROOT / "tests" / "vllm_cli.py"), "serve",
            *cli_args({**_vllm_args(model), **layout, "node_rank": 1}), "--headless"]
    return {**llm, **layout, "node_rank": 0}, node


def run_once(backend: str, hosts: tuple[netns.Host, netns.Host], model: Path, keys: Path,
             work: Path, args: argparse.Namespace, fault: str | None = None,
             serving: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine and one node; with ``fault``, applied to rank 1 once generating; with
    ``serving`` (rate, requests, max_tokens), requests arriving over time instead of one
    timed batch."""
    import psutil

    a, b = hosts
    llm, node_cmd = commands(backend, a, model, keys, restarts=fault is None)
    tag = f"{backend}-{fault or 'run'}-{time.monotonic_ns()}"
    config, out, log = (work / f"{tag}.{x}" for x in ("config.json", "json", "log"))
    prompts = [[(7 * i + j) % 500 + 1 for j in range(8 + i % 5)] for i in range(args.prompts)]
    tokens = args.max_tokens if fault is None else 256 - max(map(len, prompts))  # running
    config.write_text(json.dumps({"llm": llm, "prompts": prompts, "max_tokens": tokens,
                                  "peer": b.addr, "fault": fault, "serving": serving}))
    with open(log, "w") as engine_log, open(work / f"{tag}.node.log", "w") as node_log:
        engine = subprocess.Popen(
            a.run(sys.executable, "-m", "engine_side.bench.vllm_nodes_engine", str(config),
                  str(out)), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=engine_log,
            env={**ENV, "GLOO_SOCKET_IFNAME": a.dev, "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                 "VLLM_HOST_IP": a.addr})
        node = subprocess.Popen(
            b.run(*node_cmd), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=node_log,
            env={**ENV, "GLOO_SOCKET_IFNAME": b.dev, "VLLM_CPU_OMP_THREADS_BIND": "1|0",
                 "VLLM_HOST_IP": b.addr})
        at = None
        try:
            if fault is not None:
                while "WARM" not in log.read_text():
                    if engine.poll() is not None:
                        break
                    time.sleep(0.1)
                time.sleep(1.0)  # the timed generate is under way
                ranks = [c for c in psutil.Process(node.pid).children()
                         if "DeltaWorker" in " ".join(c.cmdline())]
                at = time.time()
                if fault == "kill":
                    ranks[0].send_signal(signal.SIGKILL)
                elif fault == "stop":
                    ranks[0].send_signal(signal.SIGSTOP)
                else:
                    subprocess.run(["ip", "-n", b.ns, "link", "set", b.dev, "down"], check=True)
            engine.wait(args.timeout)
        finally:
            if fault == "link":
                subprocess.run(["ip", "-n", b.ns, "link", "set", b.dev, "up"])
            for host in (a, b):
                host.kill_all()
            for p in (engine, node):
                p.wait()
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    result["backend"], result["fault"] = backend, fault
    if at is not None and "error_at" in result:
        result["detected_s"] = result["error_at"] - at
    if "tokens" not in result and fault is None:
        raise RuntimeError(f"{backend} run failed: {result.get('error')}; see {log}")
    return result


def rounds(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from engine_side.bench.vllm_scenarios import build_tiny_model
    from engine_side.keys import write_keys

    model = build_tiny_model(work / "tiny-llama")
    keys = work / "keys"
    write_keys(keys, 1)
    runs: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    with netns.two_hosts("b") as hosts:
        if args.serving_rate:
            return serving_rounds(args, hosts, model, keys, work)
        for i in range(args.rounds):
            order = ("delta", "vllm") if i % 2 == 0 else ("vllm", "delta")
            for backend in order:
                r = run_once(backend, hosts, model, keys, work, args)
                r["round"] = i + 1
                runs.append(r)
                print(f"round {i + 1} {backend}: {r['tokens'] / r['seconds']:.0f} tok/s, "
                      f"channel {r['bytes']['channel']:,} B", file=sys.stderr)
        for fault in args.faults:
            r = run_once("delta", hosts, model, keys, work, args, fault)
            faults.append(r)
            print(f"fault {fault}: detected in {r.get('detected_s', float('nan')):.2f} s",
                  file=sys.stderr)
    return {"prompts": args.prompts, "max_tokens": args.max_tokens, "runs": runs,
            "faults": faults, "link": LINK}


def serving_rounds(args: argparse.Namespace, hosts: tuple[netns.Host, netns.Host],
                   model: Path, keys: Path, work: Path) -> dict[str, Any]:
    """Requests arriving over time (engine_side.bench.vllm_serving) to both backends,
    alternating: a document :func:`engine_side.bench.page_serving.from_serving` reads,
    vLLM's multi-node mode in the place of its default executor."""
    from engine_side.bench.vllm_serving import finish, ratios

    rate, seconds, n = args.serving_rate, args.serving_seconds, args.serving_max_tokens
    load: dict[str, Any] = {"rate": rate, "requests": max(1, round(rate * seconds)),
                            "rounds": []}
    spec = {"rate": rate, "requests": load["requests"], "max_tokens": n}
    for i in range(args.rounds):
        row: dict[str, Any] = {"round": i + 1}
        for backend in ("delta", "vllm") if i % 2 == 0 else ("vllm", "delta"):
            r = run_once(backend, hosts, model, keys, work, args, serving=spec)
            row["delta" if backend == "delta" else "default"] = r
            print(f"serving round {i + 1} {backend}: ITL p50 {r['itl_ms']['p50']:.2f} ms, "
                  f"p99 {r['itl_ms']['p99']:.2f}; {r['tok_s']:.0f} tok/s", file=sys.stderr)
        row["ratios"] = ratios(row["delta"], row["default"])
        load["rounds"].append(row)
    finish(load)
    return {"name": "vllm_nodes_serving", "tp": 2, "seconds": seconds, "max_tokens": n,
            "loads": [load], "complete": load["complete"],
            "baseline": "vLLM", "hosts": "a veth pair at 1 Gbit/s"}


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Per round: tok/s of both, ratio, channel bytes of both; medians; identical ids."""
    by = {(r["round"], r["backend"]): r for r in doc["runs"]}
    out = []
    for i in sorted({r["round"] for r in doc["runs"]}):
        d, v = by[(i, "delta")], by[(i, "vllm")]
        out.append({"round": i, "delta": d["tokens"] / d["seconds"],
                    "vllm": v["tokens"] / v["seconds"],
                    "delta_channel": d["bytes"]["channel"], "vllm_channel": v["bytes"]["channel"],
                    "delta_collectives": d["bytes"]["collectives"],
                    "vllm_collectives": v["bytes"]["collectives"]})
    ids = {json.dumps(r["token_ids"]) for r in doc["runs"]}
    return {"rounds": out, "identical": len(ids) == 1,
            "ratio": statistics.median(r["delta"] / r["vllm"] for r in out)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--serving-rate", type=float, default=0.0, metavar="R",
                   help="instead of batches and faults: serve requests arriving at R a "
                        "second (Poisson) for --serving-seconds to both backends, --rounds "
                        "times (engine_side.bench.vllm_serving's loop)")
    p.add_argument("--serving-seconds", type=float, default=6.0)
    p.add_argument("--serving-max-tokens", type=int, default=64,
                   help="mean output length of the served requests (0.5-1.5x)")
    p.add_argument("--json", default="", help="write the raw document here")
    p.add_argument("--figures", default="", metavar="FILE",
                   help="write the figures envelope BENCHMARKS.md is made from")
    args = p.parse_args()
    reason = netns.unavailable()
    if reason:
        print(f"vllm_nodes: {reason}", file=sys.stderr)
        return 2
    from engine_side.bench import figures
    from engine_side.bench.page_tables import write_figures

    started = figures.stamp()
    with tempfile.TemporaryDirectory(prefix="deltacast-nodes-") as tmp:
        doc = rounds(args, Path(tmp))
    if args.serving_rate:
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))
        print(json.dumps(doc["loads"][0]["median_ratios"], indent=1))
        if args.figures and doc["complete"]:
            write_figures(args.figures, "vllm_nodes_serving", doc, started)
        return 0 if doc["complete"] else 1
    doc["summary"] = summary(doc)
    for run in doc["runs"]:  # compared in the summary; not kept in the figures
        run.pop("token_ids", None)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"], indent=1))
    if args.figures:
        write_figures(args.figures, "vllm_nodes", doc, started)
    return 0 if doc["summary"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
