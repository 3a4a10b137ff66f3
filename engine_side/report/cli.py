"""``deltacast report``: replay workloads, write report.md, report.json and PNG plots."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from engine_side.report import plots
from engine_side.report.markdown import render
from engine_side.report.replay import Replay, replay
from engine_side.report.summary import headline, workload_summary
from engine_side.report.workloads import BUILTIN, load_workload

DEFAULT_STEPS = 150
SWEEP_BATCHES = (1, 32, 256, 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help=f"built-in name ({', '.join(BUILTIN)}) or a `deltacast record` "
                             "file; default: every built-in workload")
    parser.add_argument("--out", type=Path, default=Path("out/report"),
                        help="output directory (default: out/report)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"steps replayed per built-in workload (default {DEFAULT_STEPS})")
    parser.add_argument("--batch", type=int, default=None,
                        help="running requests for built-in workloads (default: per workload)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sweep", action="store_true",
                        help="skip the µs-per-step versus batch-size sweep")
    parser.add_argument("--quick", action="store_true", help="few steps, small batches (tests)")


def _progress(total: int) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=True, disable=not sys.stderr.isatty())


def _replays(args: argparse.Namespace) -> list[Replay]:
    names = args.workloads or list(BUILTIN)
    steps = 12 if args.quick else args.steps
    out = []
    with _progress(len(names)) as progress:
        for name in names:
            source = load_workload(name, steps=steps, batch=args.batch, seed=args.seed,
                                   quick=args.quick)
            task = progress.add_task(f"replaying {source.name}", total=source.steps)
            out.append(replay(source.name, itertools.islice(source.requests, source.steps),
                              source.batch, source.token_mode, source.kv_groups,
                              on_step=functools.partial(progress.advance, task)))
    return out


def _sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.no_sweep:
        return []
    from engine_side.bench.core import run_core

    batches = (1, 32) if args.quick else SWEEP_BATCHES
    return list(run_core(batches, steps=6 if args.quick else 40, scenarios=("steady_decode",)))


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        replays = _replays(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"deltacast report: {exc}", file=sys.stderr)
        return 2
    sweep = _sweep(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summaries = [workload_summary(r) for r in replays]
    figures = {
        "bytes_per_step": plots.bytes_per_step(replays, out / "bytes_per_step.png"),
        "cumulative_bytes": plots.bytes_per_step(replays, out / "cumulative_bytes.png", True),
        "breakdown": plots.breakdown(replays, out / "breakdown.png"),
    }
    if sweep:
        figures["us_vs_batch"] = plots.us_vs_batch(sweep, out / "us_vs_batch.png")
    report = {"headline": headline(summaries), "workloads": summaries, "sweep": sweep,
              "figures": {k: v.name for k, v in figures.items()},
              "command": "deltacast report " + " ".join(sys.argv[2:]),
              "seconds": round(time.monotonic() - started, 1)}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(render(report))
    print(f"wrote {out / 'report.md'}, {out / 'report.json'} and {len(figures)} plots "
          f"in {report['seconds']} s")
    return 0
