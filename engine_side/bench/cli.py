"""``deltacast bench [core|latency|mm]``: run one benchmark kind.

Each kind lives in ``engine_side.bench.<kind>`` and exposes ``run(args) -> int``;
a kind module may also expose ``add_arguments(parser)`` for options of its own
(it must not redefine the shared ones below).  Kinds whose module does not exist
yet fail with exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import sys
from typing import Any

from protocol.cli_support import int_in

KINDS = ("core", "latency", "mm")


def _module_name(kind: str) -> str:
    return f"engine_side.bench.{kind}"


def _available(kind: str) -> bool:
    return importlib.util.find_spec(_module_name(kind)) is not None


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", nargs="?", choices=KINDS, default="core",
                        help="which benchmark (default: core)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per line on stdout (see engine_side/bench/rows.py)")
    parser.add_argument("--batches", type=_batches, default=None, metavar="N,N,...",
                        help="batch sizes (default: 1,32,256,1024,4096)")
    parser.add_argument("--steps", type=int_in(1), default=None, metavar="N",
                        help="timed steps per case (default: adaptive, 200 down to 30)")
    parser.add_argument("--quick", action="store_true",
                        help="small batches and few steps (smoke tests)")
    parser.add_argument("--seed", type=int_in(0), default=0, help="workload RNG seed")
    parser.add_argument("--figures", default=None, metavar="FILE",
                        help="also write the figures envelope for BENCHMARKS.md here "
                             "(docs/benchmarks/KIND.json; implies --json)")
    for kind in KINDS[1:]:
        if _available(kind):
            hook = getattr(importlib.import_module(_module_name(kind)), "add_arguments", None)
            if hook is not None:
                hook(parser)


def run(args: argparse.Namespace) -> int:
    kind = getattr(args, "kind", "core") or "core"
    if not _available(kind):
        print(f"deltacast bench: '{kind}' is not available yet "
              f"(module {_module_name(kind)} does not exist)", file=sys.stderr)
        return 2
    module = importlib.import_module(_module_name(kind))
    if getattr(args, "figures", None):
        return _run_with_figures(module, kind, args)
    return int(module.run(args) or 0)


class _Tee:
    """stdout that also keeps what was written (the JSON rows of a run)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return int(self.out.write(text))

    def flush(self) -> None:
        self.out.flush()


def _run_with_figures(module: Any, kind: str, args: argparse.Namespace) -> int:
    """Run ``kind`` with --json, then write its rows' figures envelope (engine_side.bench.page)."""
    from engine_side.bench import figures, page_tables

    if getattr(args, "soak", 0):
        print("deltacast bench: --figures does not apply to --soak", file=sys.stderr)
        return 2
    started = figures.stamp()
    args.json = True
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        status = int(module.run(args) or 0)
    if status == 0:
        rows = [json.loads(line) for line in "".join(tee.parts).splitlines()
                if line.startswith("{")]
        page_tables.write_figures(args.figures, kind, rows, started)
    return status
