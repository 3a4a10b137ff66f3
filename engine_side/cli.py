"""The ``deltacast`` command: a thin dispatcher to subcommand modules.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``deltacast --help`` stays fast and optional dependencies stay optional.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module, one-line help).  Modules own their options.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("engine_side.bench.cli", "benchmarks against vLLM-style pickling (default: core)"),
    "demo": ("engine_side.demo", "engine + N worker processes on a synthetic workload"),
    "worker": ("worker_side.main", "run one worker process (can be started by hand on a host)"),
    "report": ("engine_side.report.cli", "wire-size report with per-field accounting and plots"),
    "record": ("engine_side.vllm.record", "record a vLLM run's scheduler stream to a file"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltacast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=text, description=text)
        if name == wanted:
            importlib.import_module(module).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
