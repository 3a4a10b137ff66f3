"""Two checkouts of deltacast on one stream, step-interleaved: which costs less per step.

Each pass replays the stream with a fresh encoder and decoder of each tree.  At every
message it times vLLM's serializer (the shared yardstick, ``vllm_replay.pickled``) and
each tree's encode + decode, rotating the order per step.  A step's figure is its request
path (execute_model + sample_tokens), the median over the passes.

Loading two trees into one process is not neutral: the tree loaded second reads 6–10 %
cheaper with the very same code (BENCHMARKS.md, twenty-fifth session).  So the driver
runs one process per load order and reports, per figure, B ÷ A in each order and their
geometric mean, in which that bias cancels.  (Imports made inside functions resolve to
the tree loaded last; the same-batch and finish paths make none.)

Run: ``python -m engine_side.bench.tree_ab STREAM TREE_A TREE_B [--passes 9] [--json F]``.
Each tree is a checkout with its C speedups built in place
(``python setup.py build_ext --inplace``).  STREAM is a recording (``.dcrec``) or
``synthetic-N``: N requests of steady decode.  Needs vLLM.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_PACKAGES = ("protocol", "engine_side", "worker_side")
_REQUEST = ("execute_model", "sample_tokens")
FIGURES = ("median", "finish", "same_batch", "summed")


def load_tree(root: str) -> dict[str, Any]:
    """The encoder and decoder classes and the replay module of the checkout at
    ``root``, imported afresh (every module of the package dropped first)."""
    for name in [n for n in sys.modules if n.split(".")[0] in _PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        tree = {"encoder": importlib.import_module("engine_side.vllm.encoder"),
                "decoder": importlib.import_module("worker_side.vllm.decoder"),
                "replay": importlib.import_module("engine_side.bench.vllm_replay"),
                "speedups": importlib.import_module("protocol.speedups").C}
    finally:
        sys.path.remove(root)
    return tree


def _stream(spec: str, replay: Any) -> list[tuple[str, Any]]:
    if spec.startswith("synthetic-"):
        return replay.synthetic_decode(int(spec.removeprefix("synthetic-")), 20)  # type: ignore[no-any-return]
    return replay.load_recording(Path(spec))  # type: ignore[no-any-return]


def _kinds(messages: list[tuple[str, Any]]) -> list[str]:
    """Per step: F (requests finish), N (requests join) or S (the rest)."""
    return ["F" if so.finished_req_ids else "N" if so.scheduled_new_reqs else "S"
            for kind, so in messages if kind == "execute_model"]


def _one_pass(messages: list[tuple[str, Any]], trees: dict[str, dict[str, Any]],
              pickled: Any, rotate: int) -> dict[str, list[float]]:
    """µs per step of the request path, for "pickle" and each tree."""
    names = ["pickle", *trees]
    routes = {}
    for name, tree in trees.items():
        enc = tree["encoder"].SchedulerOutputEncoder()
        dec = tree["decoder"].SchedulerOutputDecoder()
        routes[name] = tree["replay"]._route(enc, dec)
    out: dict[str, list[float]] = {name: [] for name in names}
    step = -1
    for kind, obj in messages:
        step += kind == "execute_model"
        at = (step + rotate) % len(names)
        for name in names[at:] + names[:at]:
            if name == "pickle":
                _, dumps_s, loads_s = pickled(kind, obj)
                seconds = dumps_s + loads_s
            else:
                encode, decode = routes[name][kind]
                t0 = time.perf_counter()
                decode(encode(obj))
                seconds = time.perf_counter() - t0
            if kind == "execute_model":
                out[name].append(0.0)
            if kind in _REQUEST and step >= 0:
                out[name][step] += seconds * 1e6
    return out


def measure(spec: str, roots: list[str], passes: int) -> dict[str, Any]:
    """Each tree's figures on ``spec`` (loaded in the order of ``roots``) and pickle's:
    the median step, the median finish step, the median same-batch step and the sum
    over steps, each step its median over ``passes`` passes."""
    trees = {root: load_tree(root) for root in roots}
    replay = trees[roots[0]]["replay"]
    messages = _stream(spec, replay)
    runs = []
    for k in range(passes):
        gc.collect()
        gc.freeze()
        runs.append(_one_pass(messages, trees, replay.pickled, k))
        gc.unfreeze()
    kinds = _kinds(messages)
    result: dict[str, Any] = {"stream": spec, "passes": passes, "order": roots, "steps": {
        kind: kinds.count(kind) for kind in "FNS"}, "trees": {}}
    for name in ["pickle", *roots]:
        per = [statistics.median(run[name][i] for run in runs) for i in range(len(kinds))]
        of = {k: [us for us, kind in zip(per, kinds, strict=True) if kind == k] for k in "FS"}
        result["trees"][name] = {
            "median": statistics.median(per), "summed": sum(per),
            "finish": statistics.median(of["F"]) if of["F"] else math.nan,
            "same_batch": statistics.median(of["S"]) if of["S"] else math.nan}
    result["speedups"] = {root: getattr(trees[root]["speedups"], "__file__", None)
                          for root in roots}
    return result


def combine(first: dict[str, Any], second: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    """B ÷ A per figure in each load order and their geometric mean."""
    out: dict[str, Any] = {}
    for figure in FIGURES:
        ratios = [run["trees"][b][figure] / run["trees"][a][figure] for run in (first, second)]
        out[figure] = {"a_first": ratios[0], "b_first": ratios[1],
                       "geometric_mean": math.sqrt(ratios[0] * ratios[1])}
    return out


def table(doc: dict[str, Any]) -> str:
    lines = [f"B = {doc['b']}, A = {doc['a']}, {doc['stream']}, {doc['passes']} passes",
             "| figure | B ÷ A, A loaded first | B ÷ A, B loaded first | geometric mean |",
             "| --- | ---: | ---: | ---: |"]
    for figure, r in doc["ratios"].items():
        lines.append(f"| {figure} | {r['a_first']:.3f} | {r['b_first']:.3f} | "
                     f"{r['geometric_mean']:.3f} |")
    return "\n".join(lines)


def _run_one(spec: str, roots: list[str], passes: int) -> dict[str, Any]:
    """:func:`measure` in a fresh process (its own load order)."""
    done = subprocess.run(  # noqa: S603 - our own module, our own arguments
        [sys.executable, "-m", "engine_side.bench.tree_ab", "--one", spec, *roots,
         "--passes", str(passes)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stream", help="a .dcrec recording, or synthetic-N")
    parser.add_argument("a", help="checkout A (the baseline)")
    parser.add_argument("b", help="checkout B")
    parser.add_argument("--passes", type=int, default=9)
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    if args.one:  # one load order, A then B, in this process
        print(json.dumps(measure(args.stream, [args.a, args.b], args.passes)))
        return 0
    a, b = str(Path(args.a).resolve()), str(Path(args.b).resolve())
    if a == b:
        parser.error("A and B are the same checkout: a module loads once per process")
    first, second = (_run_one(args.stream, order, args.passes) for order in ([a, b], [b, a]))
    doc = {"stream": args.stream, "passes": args.passes, "a": a, "b": b,
           "runs": [first, second], "ratios": combine(first, second, a, b)}
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
