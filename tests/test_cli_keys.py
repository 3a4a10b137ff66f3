"""``deltacast keys``: a deployment's CURVE keys, written privately, never overwritten,
and the flags it prints run a real engine with hand-started workers over tcp+CURVE."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth
from test_cli import CLI, REPO, assert_one_line_failure, deltacast

from engine_side.security import free_tcp_endpoint
from protocol.cli_support import EXIT_CANNOT_WRITE, EXIT_USAGE


def test_keys_are_private_loadable_and_never_overwritten(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    made = deltacast("keys", str(d), "--workers", "2")
    assert made.returncode == 0 and made.stderr == "", made.stderr
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("engine", "worker1", "worker2"):
        secret = d / f"{name}.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        public, private = zmq.auth.load_certificate(str(secret))
        assert private is not None and zmq.auth.load_certificate(str(d / f"{name}.key"))[0] \
            == public
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    again = deltacast("keys", str(d))
    assert_one_line_failure(again, EXIT_CANNOT_WRITE, "engine.key", "never overwritten")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    assert_one_line_failure(deltacast("keys", str(link)), EXIT_CANNOT_WRITE, "symlink")
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert_one_line_failure(deltacast("keys", str(tmp_path / "k"), "--workers", "0"),
                            EXIT_USAGE, "--workers")


@pytest.mark.integration
def test_the_printed_flags_run_an_engine_with_hand_started_workers(tmp_path: Path) -> None:
    made = deltacast("keys", str(tmp_path / "keys"), "--workers", "2")
    assert made.returncode == 0, made.stderr
    endpoint = free_tcp_endpoint()
    engine_line = next(line for line in made.stdout.splitlines() if line.startswith("engine:"))
    worker_line = next(line for line in made.stdout.splitlines() if line.startswith("worker"))
    engine_argv = shlex.split(engine_line.split(":", 1)[1].replace("tcp://HOST:PORT", endpoint))
    assert engine_argv[:2] == ["deltacast", "demo"]
    demo = subprocess.Popen([*CLI, *engine_argv[1:], "--no-progress", "--json",
                             "--requests", "8"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    workers = []
    try:
        for i in (1, 2):
            line = worker_line.split(":", 1)[1].replace("tcp://HOST:PORT", endpoint)
            line = line.replace("<i - 1>", str(i - 1)).replace("<i>", str(i))
            argv = shlex.split(line)
            assert argv[:2] == ["deltacast", "worker"] and not re.search(r"[<>]", line)
            workers.append(subprocess.Popen([sys.executable, "-m", "worker_side.main",
                                             *argv[2:]], cwd=REPO,
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True,
                                            env={**os.environ, "PYTHONPATH": str(REPO)}))
        out, err = demo.communicate(timeout=300)
    finally:
        for p in (demo, *workers):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)
    assert demo.returncode == 0, err[-2000:]
    summary = json.loads(out.splitlines()[-1])
    assert summary["requests_done"] == 8 and summary["mismatched"] == 0
    assert {e["rank"] for e in summary["events"] if e["event"] == "WorkerJoined"} == {0, 1}
