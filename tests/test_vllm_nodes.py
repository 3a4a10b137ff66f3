"""DeltaExecutor across two "hosts": the engine and rank 0 in one network namespace,
``deltacast node`` and rank 1 in another, over a veth pair (tests/netns.py), real vLLM
(CPU build) at TP=2.  Skipped cleanly without vLLM or network namespaces.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from shm_leftovers import node_dirs, removing_shm  # noqa: E402
from vllm_nodes_run import engine_args  # noqa: E402

from engine_side.bench import netns  # noqa: E402
from engine_side.bench.vllm_nodes import cli_args  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_node_dir_left")]
ROOT = Path(__file__).resolve().parent.parent
PORT = 29611  # each namespace has its own ports
HUNG_S = 10  # vLLM's step timeout where a rank hangs (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[netns.Host, netns.Host]]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.two_hosts("n") as pair:
        yield pair


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


def _keys(directory: Path) -> Path:
    subprocess.run([sys.executable, "-m", "engine_side.cli", "keys", str(directory)],
                   cwd=ROOT, env=ENV, check=True, capture_output=True)
    return directory


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _keys(tmp_path_factory.mktemp("keys") / "deployment")


def _engine(host: netns.Host, model: Path, out: Path, keys: Path, *extra: str
            ) -> subprocess.Popen[str]:
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (the process holds it)
    env = {**ENV, "GLOO_SOCKET_IFNAME": host.dev, "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           # (skew: LLM.collective_rpc hands a function to vLLM's engine-core process)
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1" if {"skew", "hang"} & set(extra) else "0",
           **({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(HUNG_S)} if "hang" in extra else {})}
    return subprocess.Popen(
        host.run(sys.executable, str(ROOT / "tests" / "vllm_nodes_run.py"), str(model),
                 str(out), "delta", host.addr, str(PORT), str(keys), *extra),
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _node(host: netns.Host, engine_host: netns.Host, model: Path, keys: Path, key_dir: Path,
          restarts: bool = True, **changed: Any) -> subprocess.Popen[str]:
    """``deltacast node`` for node 1 with the engine's vLLM arguments (``changed``
    overrides some: a node that built another config)."""
    argv = cli_args({**engine_args(str(model), "delta", engine_host.addr, PORT, str(keys),
                                   restarts), **changed})
    env = {**ENV, "GLOO_SOCKET_IFNAME": host.dev, "VLLM_CPU_OMP_THREADS_BIND": "1|0"}
    return subprocess.Popen(
        host.run(sys.executable, "-m", "engine_side.cli", "node", "--nnodes", "2",
                 "--node-rank", "1", "--master-addr", engine_host.addr, "--master-port",
                 str(PORT), "--keys", str(key_dir), "--engine", "llm", *argv),
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(*procs: subprocess.Popen[str], timeout: float = 300) -> list[str]:
    """Each process's stderr once it has exited (killed after ``timeout``)."""
    errs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        errs.append(err or out or "")
    return errs


def _generating(hosts: tuple[netns.Host, netns.Host], model: Path, keys: Path, out: Path,
                *modes: str, timeout: float = 300,
                ) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """(engine, node) once the engine is in its long generate (its log says WARM;
    ``modes`` end with "long", or "hold": the engine waits for OUT.go before it, or
    "twice"; before it, "norestart": a dead rank fails the engine, "skew": see
    tests/vllm_nodes_run.py)."""
    a, b = hosts
    engine = _engine(a, model, out, keys, *modes)
    node = _node(b, a, model, keys, keys, restarts="norestart" not in modes)
    log, end = out.with_suffix(".log"), time.monotonic() + timeout
    while "WARM" not in log.read_text():
        assert engine.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.2)
    return engine, node


def _gone(*hosts: netns.Host, timeout: float = 30) -> bool:
    end = time.monotonic() + timeout
    while any(h.pids() for h in hosts) and time.monotonic() < end:
        time.sleep(0.2)
    return not any(h.pids() for h in hosts)


def test_tp2_across_two_hosts_matches_the_default_executor_and_checks_tokens(
        hosts: tuple[netns.Host, netns.Host], model: Path, keys: Path, tmp_path: Path,
        default_tp2_reference: dict[str, Any]) -> None:
    """Rank 1 on the other host: the outputs are the default executor's, a sealed
    callable reaches it, and its skewed tokens are named.  Then one live session per
    key: node 1 started again with the same key while the engine runs: the ROUTER drops
    what the second sends (its rank's identity is taken), the second exits saying so
    once its hello goes unanswered, and the first then generates to the end."""
    a, b = hosts
    out = tmp_path / "delta.json"
    sent = b.tx_bytes()
    engine, node = _generating(hosts, model, keys, out, "skew", "hold")
    (twice_err,) = _finish(_node(b, a, model, keys, keys), timeout=120)
    out.with_suffix(".go").touch()
    (node_err,) = _finish(node)
    _finish(engine)
    log = out.with_suffix(".log").read_text()
    assert engine.returncode == 0 and node.returncode == 0, (log[-3000:], node_err[-3000:])
    result = json.loads(out.read_text())
    assert result["short"] == default_tp2_reference["short"]
    # a sealed callable reached the remote rank, and its skewed tokens were noticed
    assert result["skewed"] == [False, True]
    assert "DeltaExecutor rank 1 diverged" in log, log[-3000:]
    assert b.tx_bytes() - sent > 100_000  # rank 1's collectives and replies crossed the link
    assert "ranks [1] of 2" in node_err and f"gloo interface {b.dev}" in node_err
    assert "node 1 is already connected (one session per key)" in twice_err, twice_err[-3000:]
    assert "error" not in result and result["long"] == [200, 200, 200], log[-3000:]
    assert _gone(a, b), "a process outlived the run"


def _links(host: netns.Host, port: int) -> int:
    """TCP connections established from ``host`` to ``port``."""
    out = subprocess.run(host.run("ss", "-Htn", "state", "established", f"( dport = :{port} )"),
                         capture_output=True, text=True, check=True).stdout
    return len(out.splitlines())


def test_two_ranks_on_the_other_host_share_one_relay_at_tp4(
        hosts: tuple[netns.Host, netns.Host], tmp_path_factory: pytest.TempPathFactory,
        keys: Path, tmp_path: Path) -> None:
    """TP=4: node 1 runs ranks 2 and 3 behind one connection to the engine (its relay
    hands each step to both); the tokens equal vLLM's default executor's, the logprobs
    within float32's difference between gloo's all-reduce across the hosts and vLLM's
    shared-memory one on one host (not bit for bit: the sums run in another order)."""
    from engine_side.bench.vllm_scenarios import build_tiny_model

    a, b = hosts
    model = build_tiny_model(tmp_path_factory.mktemp("tp4") / "tiny-llama", heads=4)
    ref = tmp_path / "default.json"
    # vLLM's default executor at TP=4 leaves its CPU all-reduce segments (named by its
    # own file store, vllm_dist_*) behind when it exits
    with removing_shm("vllm_dist_"):
        subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_nodes_run.py"), str(model),
                        str(ref), "default", "tp4"], cwd=ROOT, timeout=600,
                       capture_output=True, env={**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"})
    out = tmp_path / "delta.json"
    engine = _engine(a, model, out, keys, "tp4", "long")
    node = _node(b, a, model, keys, keys, tensor_parallel_size=4, dtype="float32")
    log, end = out.with_suffix(".log"), time.monotonic() + 300
    while "WARM" not in log.read_text():
        assert engine.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.2)
    links = _links(b, PORT + 1)
    node_err, _ = _finish(node, engine)
    assert engine.returncode == 0 and node.returncode == 0, (log.read_text()[-3000:],
                                                              node_err[-3000:])
    assert links == 1, f"{links} connections from node 1 to the engine"
    ringed = re.search(r"calls to every rank: (\d+) through the node's ring", node_err)
    assert ringed and int(ringed[1]) > 100, node_err[-3000:]  # one copy for both ranks
    result = json.loads(out.read_text())
    want = json.loads(ref.read_text())["short"]
    assert [r[0] for r in result["short"]] == [w[0] for w in want]  # the tokens
    for (_, got), (_, expected) in zip(result["short"], want, strict=True):
        for top, top_expected in zip(got, expected, strict=True):  # logprobs, float32
            assert [t for t, _ in top] == [t for t, _ in top_expected]
            assert all(abs(p - q) < 1e-3 for (_, p), (_, q) in zip(top, top_expected,
                                                                   strict=True))
    assert result["long"] == [200] * 3
    assert "ranks [2, 3] of 4" in node_err, node_err[-3000:]
    assert _gone(a, b), "a process outlived the run"


def test_a_node_builds_a_pipeline_parallel_config_with_the_executor_named(
        model: Path) -> None:
    """vLLM allows PP only to an executor class, and a node's arguments name it."""
    from engine_side.vllm import DeltaExecutor
    from worker_side.vllm.node import build_config

    config = build_config([str(model), "--pipeline-parallel-size", "2", "--enforce-eager",
                           "--distributed-executor-backend", "engine_side.vllm.DeltaExecutor"],
                          "llm")
    assert config.parallel_config.pipeline_parallel_size == 2
    assert config.parallel_config.distributed_executor_backend is DeltaExecutor


def test_a_foreign_key_and_another_config_are_refused_by_name(
        hosts: tuple[netns.Host, netns.Host], model: Path, keys: Path, tmp_path: Path) -> None:
    a, b = hosts
    out = tmp_path / "refused.json"
    engine = _engine(a, model, out, keys)
    rogue = _keys(tmp_path / "rogue")
    (rogue / "engine.key").write_bytes((keys / "engine.key").read_bytes())
    (rogue_err,) = _finish(_node(b, a, model, keys, rogue))
    assert "refused this node's CURVE key" in rogue_err, rogue_err[-3000:]
    other = _node(b, a, model, keys, keys, max_model_len=128)
    (other_err,) = _finish(other)
    _finish(engine)
    log = out.with_suffix(".log").read_text()
    assert other.returncode == 1 and "the engine refused this node" in other_err, other_err[-3000:]
    assert engine.returncode == 0 and "error" in json.loads(out.read_text())
    assert "rank 1 (node 1" in log and "vLLM config hash" in log, log[-3000:]
    assert _gone(a, b)


def _rank_of(pid: int) -> Any:
    """The DeltaExecutor rank process among ``pid``'s descendants (one per host here)."""
    import psutil

    (rank,) = [c for c in psutil.Process(pid).children(recursive=True)
               if "DeltaWorker" in " ".join(c.cmdline())]
    return rank


def _await(engine: subprocess.Popen[str], log: Path, text: str, count: int = 1) -> None:
    end = time.monotonic() + 300
    while log.read_text().count(text) < count:
        assert engine.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.2)


def test_a_killed_rank_restarts_the_group_across_hosts_and_no_request_is_lost(
        hosts: tuple[netns.Host, netns.Host], model: Path, keys: Path, tmp_path: Path) -> None:
    """Rank 1 on the other host frozen (SIGSTOP) mid-generation: the engine sees its
    link drop and restarts the group (rank 0 here), ``deltacast node`` kills the frozen
    rank past its own liveness bound and starts it again (it rejoins over CURVE with the
    new group's secret), the scheduler recomputes, and the generation ends with every
    token.  Then, in a second generation, rank 0 here is SIGKILLed: the engine's QUIT
    tells rank 1 that its group restarts, and its node starts it again.  In a third,
    rank 1 hangs in a step, its process and links alive: past vLLM's step timeout the
    engine stops the group, rank 1 never reads the QUIT, and its node stops it 10 s
    after passing that on and starts it again.  (A remote rank SIGKILLed:
    tests/test_vllm_ray.py.)"""
    a, b = hosts
    out = tmp_path / "restarted.json"
    engine, node = _generating(hosts, model, keys, out, "hang", "twice")
    log = out.with_suffix(".log")
    first = _rank_of(node.pid)
    first.suspend()
    _await(engine, log, "SECOND")
    second = _rank_of(node.pid)
    _rank_of(engine.pid).kill()
    (node_err,) = _finish(node)
    _finish(engine)
    result, text = json.loads(out.read_text()), log.read_text()
    assert result.get("long") == result.get("long2") == [200, 200, 200], text[-3000:]
    assert result.get("stalled") == [False, True] and result.get("long3") == [200] * 3
    assert (f"restarted the group after no answer to a step within {HUNG_S} s "
            "(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)") in text, text[-3000:]
    assert "rank(s) [1] did not exit 10 s after the engine restarted the group" in node_err
    assert (f"restarted the group after node 1 (ranks [1], host {b.addr}) dropped its "
            "connection") in text, text[-3000:]
    assert "restarted the group after rank 0 died (signal 9 (SIGKILL))" in text, text[-3000:]
    assert node_err.count("its group restarts; starting ranks [1] again") == 3, node_err
    assert "rank 1 is frozen (no heartbeat for 0.6 s); killing it" in node_err, node_err
    assert "rank 1 exited with code 75 (its group restarts)" in node_err, node_err
    assert node.returncode == 0 and second.pid != first.pid
    assert _gone(a, b)


def test_a_killed_remote_rank_fails_the_engine_naming_its_node_without_restarts(
        hosts: tuple[netns.Host, netns.Host], model: Path, keys: Path, tmp_path: Path) -> None:
    a, b = hosts
    out = tmp_path / "killed.json"
    engine, node = _generating(hosts, model, keys, out, "norestart", "long")
    _rank_of(node.pid).kill()
    (node_err,) = _finish(node)
    _finish(engine)
    result, log = json.loads(out.read_text()), out.with_suffix(".log").read_text()
    assert "error" in result and "long" not in result
    assert f"node 1 (ranks [1], host {b.addr}) dropped its connection" in log, log[-3000:]
    assert node.returncode == 1 and "rank 1 exited with code -9" in node_err
    assert _gone(a, b)


def test_the_remote_node_exits_when_the_engine_dies(
        hosts: tuple[netns.Host, netns.Host], model: Path, keys: Path, tmp_path: Path) -> None:
    import psutil

    a, b = hosts
    out = tmp_path / "engine-killed.json"
    dirs = node_dirs()
    # the engine's host leaves vLLM's TP queue and semaphores (its resource tracker is
    # SIGKILLed too)
    with removing_shm("psm_", "sem.mp-"):
        engine, node = _generating(hosts, model, keys, out, "long")
        assert node_dirs() - dirs  # the node's private directory, while it runs
        for p in [*psutil.Process(engine.pid).children(recursive=True),
                  psutil.Process(engine.pid)]:
            p.send_signal(signal.SIGKILL)
        (node_err,) = _finish(node, timeout=60)
        assert node.returncode == 1 and "lost the engine" in node_err, node_err[-3000:]
        assert _gone(a, b)
        assert node_dirs() == dirs  # the node removed its directory (ring, bells, sockets)
