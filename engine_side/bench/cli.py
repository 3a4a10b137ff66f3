"""``deltacast bench [core|latency|mm]``: run one benchmark kind.

Each kind lives in ``engine_side.bench.<kind>`` and exposes ``run(args) -> int``;
a kind module may also expose ``add_arguments(parser)`` for options of its own
(it must not redefine the shared ones below).  Kinds whose module does not exist
yet fail with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", nargs="?", choices=KINDS, default="core",
                        help="which benchmark (default: core)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per line on stdout (see engine_side/bench/rows.py)")
    parser.add_argument("--batches", type=_batches, default=None, metavar="N,N,...",
                        help="batch sizes (default: 1,32,256,1024,4096)")
    parser.add_argument("--steps", type=_positive, default=None, metavar="N",
                        help="timed steps per case (default: adaptive, 200 down to 30)")
    parser.add_argument("--quick", action="store_true",
                        help="small batches and few steps (smoke tests)")
    parser.add_argument("--seed", type=int, default=0, help="workload RNG seed (default: 0)")
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
    return int(importlib.import_module(_module_name(kind)).run(args) or 0)
