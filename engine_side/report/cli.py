"""``deltacast report``: replay workloads, write report.md, report.json and PNG plots."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from engine_side.report import plots
from engine_side.report.markdown import render
from engine_side.report.replay import Replay, replay
from engine_side.report.summary import headline, workload_summary
from engine_side.report.workloads import BUILTIN, load_workload
from protocol.cli_support import EXIT_CANNOT_WRITE, EXIT_NO_INPUT, CliError, int_in

DEFAULT_STEPS = 150
SWEEP_BATCHES = (1, 4, 16, 64, 256, 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help=f"a built-in workload ({', '.join(BUILTIN)}) or a `deltacast "
                             "record` file; default: every built-in workload")
    parser.add_argument("--out", type=Path, default=Path("out/report"), metavar="DIR",
                        help="output directory (created if missing)")
    parser.add_argument("--steps", type=int_in(1), default=DEFAULT_STEPS,
                        help="steps replayed per built-in workload")
    parser.add_argument("--batch", type=int_in(1), default=None,
                        help="running requests for built-in workloads (default: per workload)")
    parser.add_argument("--seed", type=int_in(0), default=0, help="workload seed")
    parser.add_argument("--no-sweep", action="store_true",
                        help="skip the µs-per-step versus batch-size sweep")
    parser.add_argument("--quick", action="store_true",
                        help="few steps, small batches (smoke tests)")


def check_inputs(args: argparse.Namespace) -> None:
    """Every WORKLOAD is a built-in or a readable file; --out is (or can be) a writable
    directory.  CliError otherwise, before any work."""
    for name in args.workloads:
        if name in BUILTIN:
            continue
        path = Path(name)
        if not path.exists():
            raise CliError(f"{name}: no such file (a WORKLOAD is a built-in name: "
                           f"{', '.join(BUILTIN)}; or a `deltacast record` file)", EXIT_NO_INPUT)
        if not path.is_file() or not os.access(path, os.R_OK):
            raise CliError(f"{name}: not a readable file (a WORKLOAD is a built-in name or a "
                           "`deltacast record` file)", EXIT_NO_INPUT)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a directory; choose a directory",
                       EXIT_CANNOT_WRITE)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"--out {out}: cannot create it ({exc.strerror}); choose a directory "
                       "you can write", EXIT_CANNOT_WRITE) from exc
    if not os.access(out, os.W_OK | os.X_OK):
        raise CliError(f"--out {out}: not writable; choose a directory you can write",
                       EXIT_CANNOT_WRITE)


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

    batches = (1, 8, 32) if args.quick else SWEEP_BATCHES
    return list(run_core(batches, steps=6 if args.quick else 40, scenarios=("steady_decode",)))


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    check_inputs(args)
    try:
        replays = _replays(args)
    except (FileNotFoundError, ValueError) as exc:  # e.g. a file that is not a recording
        raise CliError(str(exc), EXIT_NO_INPUT) from exc
    sweep = _sweep(args)
    out: Path = args.out
    summaries = [workload_summary(r) for r in replays]
    figures = {
        "bytes_per_step": plots.bytes_per_step(replays, out / "bytes_per_step.png"),
        "cumulative_bytes": plots.bytes_per_step(replays, out / "cumulative_bytes.png", True),
        "breakdown": plots.breakdown(replays, out / "breakdown.png"),
        "us_per_workload": plots.us_per_workload(summaries, out / "us_per_workload.png"),
    }
    if sweep:
        figures["us_vs_batch"] = plots.us_vs_batch(sweep, out / "us_vs_batch.png")
    report = {"headline": headline(summaries), "workloads": summaries, "sweep": sweep,
              "figures": {k: v.name for k, v in figures.items()},
              "command": "deltacast report " + " ".join(sys.argv[2:]),
              "seconds": round(time.monotonic() - started, 1)}
    try:
        (out / "report.json").write_text(json.dumps(report, indent=1))
        (out / "report.md").write_text(render(report))
    except OSError as exc:
        raise CliError(f"cannot write {exc.filename}: {exc.strerror}", EXIT_CANNOT_WRITE) \
            from exc
    print(f"wrote {out / 'report.md'}, {out / 'report.json'} and {len(figures)} plots "
          f"in {report['seconds']} s")
    return 0
