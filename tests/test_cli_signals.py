"""Signals, leftovers and chaos (issue 39): ``deltacast demo`` with real worker processes.

Each demo runs with its own TMPDIR, so its run directories (``dc-*``) can be counted
without seeing other runs.  It is started in a process group of its own and the
signal goes to that whole group, as a Ctrl-C at a terminal would: the workers sit in
groups of their own (the engine stops them), so one line is printed, not one per
process.  After a ``kill -9`` of the engine its directories stay behind with their
locks free, and the next engine removes them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol.stale_dirs import sweep_stale_dirs

REPO = Path(__file__).resolve().parent.parent
JOINED = "workers joined"


@pytest.fixture
def tmpdir_short() -> Iterator[Path]:
    """A private TMPDIR with a short path (ipc socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dcs-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pid: int, polls: int) -> bool:
    """Poll (every 50 ms, at most ``polls`` times) until ``pid`` is gone."""
    for _ in range(polls):
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _start_demo(tmp: Path, *extra: str) -> tuple[subprocess.Popen[str], list[str]]:
    """A demo with two workers, running until signalled; returns once every worker
    joined (the engine says so with -v), with the stderr lines read so far."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("XDG_RUNTIME_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_side.cli", "demo", "-v", "--workers", "2",
         "--requests", "100000", *extra],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # (bounded by the engine's own join timeout)
        seen.append(line)
        if JOINED in line:
            return proc, seen
    proc.wait(30)
    raise AssertionError("the demo ended before its workers joined:\n" + "".join(seen))


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_demo_cleanly(tmpdir_short: Path, sig: signal.Signals) -> None:
    proc, seen = _start_demo(tmpdir_short)
    workers = _children(proc.pid)
    assert len(workers) == 2
    assert [p.name for p in tmpdir_short.iterdir() if p.name.startswith("dc-")]
    os.killpg(proc.pid, sig)  # the whole group, as a terminal's Ctrl-C
    try:
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = "".join(seen) + rest
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "internal error" not in err, err
    interrupted = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert interrupted == [f"deltacast demo: interrupted by {sig.name}; stopped cleanly"], err
    assert [w for w in workers if _alive(w)] == []  # the engine reaped them before exiting
    assert list(tmpdir_short.iterdir()) == []  # run directory, keys: all gone


@pytest.mark.integration
def test_after_kill_9_the_workers_leave_and_the_next_engine_sweeps(tmpdir_short: Path) -> None:
    proc, _ = _start_demo(tmpdir_short)
    workers = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    left = sorted(p.name for p in tmpdir_short.iterdir())
    assert any(n.startswith("dc-keys-") for n in left) and len(left) == 2, left
    # the workers give up on their own (the demo gives them --engine-timeout 10) ...
    for pid in workers:
        assert _gone(pid, polls=600), f"worker {pid} outlived its engine"
    # ... and the next engine (here: its sweep) removes what the dead one left
    assert sorted(p.name for p in sweep_stale_dirs([tmpdir_short])) == left
    assert list(tmpdir_short.iterdir()) == []


@pytest.mark.integration
def test_the_stall_example_of_the_help_shows_resyncs() -> None:
    """``demo --help`` says a stall past the step ring resyncs, and gives a command that
    shows it; the run still completes with every rank agreeing."""
    example = "--stall 10 --stall-seconds 2.5 --ring-kb 1 --requests 256"
    page = subprocess.run([sys.executable, "-m", "engine_side.cli", "demo", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert example in " ".join(page.stdout.split())
    proc = subprocess.run([sys.executable, "-m", "engine_side.cli", "demo", "--json",
                           *example.split()], cwd=REPO, capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stalls"] >= 1 and summary["resyncs"] >= 1, summary
    assert summary["requests_done"] == 256 and summary["mismatched"] == 0


class _SignalsWhenCollected:
    """A finalizer that receives the signal: Python only prints what it raises there."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGTERM)


def test_a_signal_swallowed_by_a_finalizer_still_stops_the_command() -> None:
    from protocol.cli_support import guarded

    steps = []

    def body() -> int:
        _SignalsWhenCollected()  # collected at once: the signal lands in its __del__
        for step in range(100_000):  # a command's main loop, which must be stopped
            steps.append(step)
        return 0

    hook = sys.unraisablehook
    status = guarded("deltacast", body, debug=lambda: False)
    assert status == 128 + signal.SIGTERM
    assert len(steps) < 100_000
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert sys.unraisablehook is hook  # (pytest's, here) restored
