"""The two-host namespaces of the tests and benchmarks go with their run: on a normal
exit, on SIGTERM, and (killed outright) when the next run starts."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from engine_side.bench import netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None,
                                reason=str(netns.unavailable()))

_HOLD = textwrap.dedent("""
    import sys, time
    from engine_side.bench import netns
    with netns.two_hosts("t") as (a, b):
        print(a.ns, b.ns, flush=True)
        time.sleep(120)
""")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split(" ", 1)[0] for line in out.splitlines() if line.strip()}


def _holder() -> tuple[subprocess.Popen[str], set[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    names = set(proc.stdout.readline().split())
    assert len(names) == 2 and names <= _namespaces()
    return proc, names


def test_sigterm_removes_the_namespaces() -> None:
    proc, names = _holder()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not names & _namespaces()


def test_the_next_run_sweeps_what_a_killed_one_left() -> None:
    proc, names = _holder()
    proc.kill()
    proc.wait(30)
    assert names <= _namespaces()  # SIGKILL: nothing ran
    with netns.two_hosts("s") as (a, b):
        assert not names & _namespaces()
        assert {a.ns, b.ns} <= _namespaces()
    assert not {a.ns, b.ns} & _namespaces()
