"""A benchmark's child processes go with it: SIGTERM as SystemExit, and child groups.

A benchmark that runs ``LLM`` children or network namespaces must not leave them behind
when it is stopped.  :func:`exits_on_sigterm` makes SIGTERM raise SystemExit in the main
thread while it is held, so ``finally`` blocks run (Python's default for SIGTERM ends
the process without them); :func:`run_in_group` runs a command in a process group of
its own and stops the whole group -- SIGTERM, then SIGKILL after ``GRACE_S`` -- when it
outlives its timeout or its parent is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

GRACE_S = 10.0  # a stopped child group's time to exit on SIGTERM before SIGKILL


def _terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the cleanup
    raise SystemExit(128 + signum)


@contextmanager
def exits_on_sigterm() -> Iterator[None]:
    """While held (in the main thread; elsewhere it does nothing), SIGTERM raises
    SystemExit(143) once, and later ones are ignored while the ``finally`` blocks run;
    the previous handler comes back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_in_group(argv: list[str], timeout: float, **popen: Any) -> tuple[int, str, str]:
    """``argv`` in a new session (its own process group), stdout and stderr captured as
    text: (exit status, stdout, stderr).  Past ``timeout`` seconds -- or when this
    process is stopped (SystemExit, KeyboardInterrupt) -- the whole group is stopped and
    the exception propagates (subprocess.TimeoutExpired for the timeout)."""
    with exits_on_sigterm():
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, **popen)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            stop_group(proc)
            raise
    return proc.returncode, out, err


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to ``proc``'s process group (it leads one: ``start_new_session``), SIGKILL
    to what is left after GRACE_S; reaps ``proc``."""
    if proc.returncode is not None:
        return  # reaped: its group id may name another group by now
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=GRACE_S)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
