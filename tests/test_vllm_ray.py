"""DeltaExecutor placed by Ray across two "hosts": a Ray head (engine, rank 0) in one
network namespace and a Ray worker node in another, one CPU each, so the placement group
puts rank 1 on the other node; real vLLM (CPU build) at TP=2.  Skipped cleanly without
vLLM, Ray or network namespaces.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")
pytest.importorskip("ray", reason="Ray is not installed (pip install 'deltacast[ray]')")

from shm_leftovers import node_dirs, removing_shm  # noqa: E402

from engine_side.bench import netns  # noqa: E402
from protocol.stale_dirs import sweep_stale_dirs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_node_dir_left")]
ROOT = Path(__file__).resolve().parent.parent
RAY_PORT = 6379
RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
       "RAY_DISABLE_USAGE_STATS": "1", "RAY_ADDRESS": "",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[netns.Host, netns.Host]]:
    """A two-node Ray cluster, one CPU per node, head in A; stopped and emptied after."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    temp = tmp_path_factory.mktemp("ray")
    with netns.two_hosts("r") as (a, b):
        try:
            for host, first, bind in ((a, ["--head", f"--port={RAY_PORT}",
                                           "--include-dashboard=false", f"--temp-dir={temp}"],
                                       "0|1"),
                                      (b, [f"--address={a.addr}:{RAY_PORT}"], "1|0")):
                subprocess.run(host.run(RAY, "start", *first, f"--node-ip-address={host.addr}",
                                        "--num-cpus=1", "--disable-usage-stats"),
                               env={**ENV, "VLLM_CPU_OMP_THREADS_BIND": bind}, check=True,
                               capture_output=True, timeout=120)
            yield a, b
        finally:
            for host in (b, a):
                subprocess.run(host.run(RAY, "stop", "--force"), capture_output=True, env=ENV)
                host.kill_all()


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def _ranks(host: netns.Host) -> list[int]:
    """This host's DeltaExecutor rank processes: by their title, or as the children of
    the Ray actor that started them."""
    import psutil

    found = []
    for pid in host.pids():
        try:
            proc = psutil.Process(pid)
            title = " ".join(proc.cmdline()) + " " + proc.name()
            if "DeltaWorker" in title or "VLLM::Delta" in title:
                found.append(pid)
            elif "RayNode" in title:
                found += [c.pid for c in proc.children() if "resource_tracker" not in
                          " ".join(c.cmdline())]
        except psutil.Error:  # gone meanwhile
            continue
    return sorted(set(found))


def _processes(host: netns.Host) -> str:
    """What runs in ``host`` (for a failure's message)."""
    import psutil

    lines = []
    for pid in host.pids():
        try:
            lines.append(f"{pid} {psutil.Process(pid).name()} "
                         f"{' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.Error:
            continue
    return "\n".join(lines)


def _engine(a: netns.Host, model: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (the process holds it)
    return subprocess.Popen(
        a.run(sys.executable, str(ROOT / "tests" / "vllm_nodes_run.py"), str(model), str(out),
              "ray", a.addr, str(RAY_PORT), "", *extra),
        cwd=ROOT, env={**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, stdout=subprocess.DEVNULL,
        stderr=log, text=True)


def _generating(a: netns.Host, b: netns.Host, model: Path, out: Path, mode: str = "long",
                timeout: float = 400) -> tuple[subprocess.Popen[str], Path, int]:
    """(engine, its log, the rank on ``b``) once the engine is in its long generate (the
    log says WARM; ``mode``: tests/vllm_nodes_run.py's)."""
    engine = _engine(a, model, out, mode)
    log, end = out.with_suffix(".log"), time.monotonic() + timeout
    while "WARM" not in log.read_text():
        assert engine.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.2)
    ranks = _ranks(b)
    assert len(ranks) == 1, (f"ranks on the other node: {ranks}; engine "
                             f"{'running' if engine.poll() is None else engine.returncode}\n"
                             f"{_processes(b)}\n{log.read_text()[-3000:]}")
    return engine, log, ranks[0]


def _wait_gone(host: netns.Host, timeout: float = 30) -> list[int]:
    end = time.monotonic() + timeout
    while _ranks(host) and time.monotonic() < end:
        time.sleep(0.2)
    return _ranks(host)


def test_ranks_placed_by_ray_on_another_host_match_the_default_executor(
        cluster: tuple[netns.Host, netns.Host], model: Path, tmp_path: Path,
        default_tp2_reference: dict[str, Any]) -> None:
    a, b = cluster
    out = tmp_path / "ray.json"
    sent = b.tx_bytes()
    engine = _engine(a, model, out)
    engine.wait(timeout=600)
    log = out.with_suffix(".log").read_text()
    result = json.loads(out.read_text())
    assert engine.returncode == 0 and "short" in result, log[-3000:]
    assert result["short"] == default_tp2_reference["short"]
    # the actor on B started rank 1 there, gloo on the interface holding B's Ray address
    assert "ranks [1] of 2" in log and f"gloo interface {b.dev}" in log, log[-3000:]
    assert b.tx_bytes() - sent > 100_000  # rank 1's collectives and replies crossed the link
    assert _wait_gone(b) == [] and _wait_gone(a) == [], "a rank outlived the engine"


def test_a_killed_ray_placed_rank_restarts_the_group_and_the_ranks_exit_with_the_engine(
        cluster: tuple[netns.Host, netns.Host], model: Path, tmp_path: Path) -> None:
    """The rank on the other node SIGKILLed mid-generation: the engine restarts the
    group, the Ray actor starts its rank again (as ``deltacast node`` does), and the
    generation ends with every token (tests/test_vllm_nodes.py: restarts turned off,
    the executor fails naming the node).  Then, in a second generation, the engine's
    process tree SIGKILLed: the ranks on both nodes exit (the engine's connection lost,
    and Ray ends the dead driver's actor)."""
    import psutil

    a, b = cluster
    out = tmp_path / "killed.json"
    dirs = node_dirs()
    # the engine's host, SIGKILLed below with its resource tracker, leaves vLLM's TP
    # queues and semaphores
    with removing_shm("psm_", "sem.mp-"):
        engine, log, rank = _generating(a, b, model, out, "twice")
        os.kill(rank, signal.SIGKILL)
        end = time.monotonic() + 400
        while "SECOND" not in log.read_text():
            assert engine.poll() is None and time.monotonic() < end, \
                (out.read_text() if out.exists() else "") + log.read_text()[-3000:]
            time.sleep(0.2)
        result, text = json.loads(out.read_text()), log.read_text()
        assert result.get("long") == [200, 200, 200] and "error" not in result, text[-3000:]
        assert (f"restarted the group after node 1 (ranks [1], host {b.addr}) dropped its "
                "connection") in text, text[-3000:]
        assert "its group restarts; starting ranks [1] again" in text, text[-3000:]
        assert len(_ranks(b)) == 1, _processes(b)
        for p in [*psutil.Process(engine.pid).children(recursive=True),
                  psutil.Process(engine.pid)]:
            p.send_signal(signal.SIGKILL)
        engine.wait(timeout=60)
        assert _wait_gone(b) == [] and _wait_gone(a) == [], "a rank outlived the engine"
    # Ray ends the dead driver's actor with its ranks (SIGKILL), some seconds after the
    # ranks: its node's private directory is left to the sweep the next node or engine on
    # that host makes at its start, which removes it once its lock is free (an actor
    # still alive holds it; tests/conftest.py: then nothing is left)
    end = time.monotonic() + 60
    while node_dirs() - dirs and time.monotonic() < end:
        sweep_stale_dirs()
        time.sleep(0.5)
