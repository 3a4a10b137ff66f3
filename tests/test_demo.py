"""``deltacast demo`` end to end: real engine and worker processes, chaos, CURVE, netns.

Every run compares its outputs with an in-process reference (``--reference``)
and reports worker agreement; assertions are on the JSON summary, never on
elapsed time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from engine_side.bench import netns
from engine_side.security import free_tcp_endpoint
from protocol.cli_support import EXIT_ENDPOINT

REPO = Path(__file__).resolve().parent.parent


def demo(*args: str, timeout: float = 240) -> tuple[int, dict[str, Any], str]:
    cmd = [sys.executable, "-m", "engine_side.cli", "demo", "--no-progress", "--json", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return proc.returncode, (json.loads(lines[-1]) if lines else {}), proc.stderr


def _leftover_workers(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "worker_side.main" in cmdline and marker in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.mark.integration
def test_killed_worker_is_reported_restarted_and_agrees_from_its_first_step() -> None:
    base = Path(tempfile.mkdtemp(prefix="dct-", dir="/tmp"))
    endpoint = f"ipc://{base}/e"
    try:
        code, summary, err = demo("--workers", "2", "--requests", "20", "--max-tokens", "24",
                                  "--kill-every", "12", "--reference", "--endpoint", endpoint)
        assert code == 0, err[-3000:]
        assert summary["reference_ok"] is True and summary["requests_done"] == 20
        assert summary["kills"] >= 1 and summary["restarts"] >= 1
        dead = [e for e in summary["events"] if e["event"] == "WorkerDead"]
        assert any("exited with status -9" in e["reason"] for e in dead)
        assert summary["mismatched"] == 0 and summary["divergent_ranks"] == []
        assert summary["rejoined_compared"] >= 1  # a restarted rank's first step was checked
        # clean shutdown: no ipc files, no worker processes
        assert not (base / "e").exists()
        assert _leftover_workers(endpoint) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.integration
def test_demo_over_tcp_with_curve() -> None:
    endpoint = free_tcp_endpoint()
    code, summary, err = demo("--workers", "2", "--requests", "6", "--endpoint", endpoint,
                              "--curve")
    assert code == 0, err[-3000:]
    assert summary["requests_done"] == 6 and summary["compared"] > 0
    assert summary["mismatched"] == 0


def test_demo_refuses_tcp_without_keys_or_insecure_flag() -> None:
    code, _, err = demo("--endpoint", "tcp://127.0.0.1:45999", "--requests", "1", timeout=60)
    assert code == EXIT_ENDPOINT
    assert "refusing to bind tcp://127.0.0.1:45999 without CURVE" in err


@pytest.mark.integration
def test_workers_in_another_network_namespace_over_tcp_with_curve(tmp_path: Path) -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.two_hosts("d") as (engine_host, worker_host):
        _run_split_engine(engine_host, worker_host, tmp_path)


def _run_split_engine(engine_host: netns.Host, worker_host: netns.Host, tmp_path: Path) -> None:
    """Engine in one namespace, a hand-started worker in the other, CURVE over the veth."""
    from engine_side.security import generate_keypair

    server_pub, _ = generate_keypair(tmp_path, "engine")
    worker_pub, worker_secret = generate_keypair(tmp_path, "worker")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine = subprocess.Popen(
        engine_host.run(
            sys.executable, "-m", "engine_side.cli", "demo",
            "--no-progress", "--json", "--workers", "0", "--remote-workers", "1",
            "--requests", "6", "--reference", "--endpoint", f"tcp://{engine_host.addr}:47100",
            "--server-secret-key", str(tmp_path / "engine.key_secret"),
            "--allow-key", str(worker_pub)),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = subprocess.Popen(
        worker_host.run(
            sys.executable, "-m", "worker_side.main",
            "--connect", f"tcp://{engine_host.addr}:47100", "--rank", "0", "--model-seed", "0",
            "--num-blocks", "256", "--server-key", str(server_pub),
            "--secret-key", str(worker_secret)),
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        out, err = engine.communicate(timeout=180)
        worker.wait(30)
    finally:
        for p in (engine, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert engine.returncode == 0, err[-3000:]
    summary = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert summary["reference_ok"] is True and summary["mismatched"] == 0
    assert worker.returncode == 0


@pytest.mark.integration
def test_bench_latency_quick_rows_follow_the_schema() -> None:
    from engine_side.bench.rows import row_problems

    cmd = [sys.executable, "-m", "engine_side.cli", "bench", "latency", "--quick", "--json",
           "--transports", "ipc"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [(r["workers"], r["batch"]) for r in rows] == [(1, 1), (1, 256)]
    for row in rows:
        assert row_problems(row) == []
        assert row["format"] == "deltacast" and row["cpu_s_per_step"] > 0
