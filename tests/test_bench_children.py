"""A benchmark's children go with it: an LLM child that outlives its timeout, or whose
benchmark is stopped with SIGTERM, is stopped with everything it started; so are the
shards of a fuzz campaign stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine_side.bench.vllm_scenarios import ROOT, run_child

# A stand-in for a benchmark child: it starts a grandchild (as an LLM starts its engine
# and workers), notes both pids, then writes its result -- or, with "hang", never does;
# "stubborn" also ignores SIGTERM.
_CHILD = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    pids, out, mode = sys.argv[1:4]
    if mode == "stubborn":  # (SIGKILL alone stops it)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pids + ".tmp", "w") as f:
        json.dump([os.getpid(), grandchild.pid], f)
    os.replace(pids + ".tmp", pids)
    if mode in ("hang", "stubborn"):
        time.sleep(600)
    with open(out, "w") as f:
        json.dump({"tokens": 42}, f)
    grandchild.kill()
""")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _gone(pids: list[int], within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while any(map(_alive, pids)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(path: Path, within: float = 60.0) -> list[int]:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    pids: list[int] = json.loads(path.read_text())
    return pids


@contextmanager
def _reaped(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``proc``, killed and reaped when the test leaves it running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stopped_with(proc: subprocess.Popen[bytes], started: list[int]) -> None:
    """``proc`` exits as SIGTERM makes it (status 143), and ``started`` are gone."""
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert _gone(started, within=5), f"left running: {[p for p in started if _alive(p)]}"


@pytest.fixture
def child(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "bench_child.py").write_text(_CHILD)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_result_comes_back(tmp_path: Path, child: dict[str, str]) -> None:
    out = tmp_path / "out.json"
    got = run_child("bench_child", [str(tmp_path / "pids"), str(out), "done"], out,
                    "child run", env=child, timeout=60)
    assert got == {"tokens": 42}


def test_a_child_past_its_timeout_goes_with_what_it_started(
        tmp_path: Path, child: dict[str, str]) -> None:
    out, pids = tmp_path / "out.json", tmp_path / "pids"
    with pytest.raises(RuntimeError, match="child run did not finish in 3 s"):
        run_child("bench_child", [str(pids), str(out), "hang"], out, "child run",
                  env=child, timeout=3)
    started = _pids(pids, within=0)
    assert _gone(started), f"left running: {[p for p in started if _alive(p)]}"


def _bench(pids: Path, out: Path, mode: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A benchmark process running the stand-in child with ``run_child``."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from engine_side.bench.vllm_scenarios import run_child
        run_child("bench_child", [{str(pids)!r}, {str(out)!r}, {mode!r}], Path({str(out)!r}),
                  "child run", env={env!r})
        """)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("mode", ["hang", "stubborn"])
def test_sigterm_to_the_benchmark_stops_its_child_group(
        tmp_path: Path, child: dict[str, str], mode: str) -> None:
    """SIGTERM to the benchmark stops its child's group; a child that ignores SIGTERM is
    killed after the grace period, and a second SIGTERM meanwhile does not cut that
    short."""
    out, pids = tmp_path / "out.json", tmp_path / "pids"
    with _reaped(_bench(pids, out, mode, child)) as bench:
        started = _pids(pids)
        bench.send_signal(signal.SIGTERM)
        if mode == "stubborn":
            time.sleep(1.0)
            bench.send_signal(signal.SIGTERM)
        _stopped_with(bench, started)


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_sigterm_to_a_fuzz_campaign_stops_its_shards() -> None:
    with _reaped(subprocess.Popen(
            [sys.executable, "-m", "engine_side.bench.fuzz", "--cases", "10000000",
             "--jobs", "2"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)})) as campaign:
        deadline = time.monotonic() + 60
        while len(shards := _children(campaign.pid)) < 2:
            assert time.monotonic() < deadline, "the campaign started no shards"
            time.sleep(0.1)
        campaign.send_signal(signal.SIGTERM)
        _stopped_with(campaign, shards)
