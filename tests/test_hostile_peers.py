"""Hostile peers against a real engine and real workers (``deltacast demo --reference``,
two local workers) over tcp+CURVE and ipc: a peer that got past authentication sends
values nested past the recursion limit, results for other ranks with forged rows and
tokens, check-ins and Goodbyes for other processes, snapshot requests as other ranks,
replays of all of it, floods of snapshot requests and of CURVE handshakes; and an
endpoint that is a symlink.  Every run must complete every request with the
reference's outputs, flag no honest rank and exit 0.  Assertions are on the demo's JSON
summary (counts), never on elapsed time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_side.bench import hostile
from engine_side.security import free_tcp_endpoint
from protocol.cli_support import EXIT_ENDPOINT

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
REQUESTS = 48


@pytest.fixture(scope="module")
def keydir() -> Iterator[Path]:
    with hostile.keys() as path:
        yield path


@pytest.fixture()
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dch-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o700)
        yield Path(tmp)


def _check_honest(run: dict[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    assert run["code"] == 0, run["stderr"]
    assert s["reference_ok"] is True and s["requests_done"] == REQUESTS
    assert s["divergent_ranks"] == [] and s["mismatched"] == 0 and s["bad_results"] == 0
    assert not [e for e in s["events"] if e["event"] in ("WorkerDead", "WorkerStuck")]
    refused: dict[str, Any] = s["refused"]
    return refused


def test_a_key_holder_running_every_attack_over_tcp_curve_changes_nothing(
        keydir: Path) -> None:
    run = hostile.demo(free_tcp_endpoint(), keydir, REQUESTS, [], ["--mode", "mix"])
    refused = _check_honest(run)
    assert run["peer"]["sent"] > 100 and run["peer"]["epoch_seen"], run["peer"]
    # its results and check-ins for ranks 0 and 1 (the local workers' key owns them),
    # for -5 and 7 (no such ranks), its nested and garbage frames: all refused
    assert refused.get("rank taken") and refused.get("unknown rank"), refused
    assert refused.get("undecodable") and refused.get("muted"), refused


def test_a_local_process_running_every_attack_over_ipc_changes_nothing(
        short_dir: Path) -> None:
    run = hostile.demo(f"ipc://{short_dir}/e", None, REQUESTS, [], ["--mode", "mix"])
    refused = _check_honest(run)
    assert run["peer"]["sent"] > 100 and run["peer"]["epoch_seen"], run["peer"]
    # the demo named each rank's process: the intruder may speak for none of them
    assert refused.get("rank taken") and refused.get("second session"), refused
    assert refused.get("undecodable"), refused


def test_a_snapshot_flood_from_one_identity_is_rate_limited_and_no_rank_dies(
        keydir: Path) -> None:
    """The peer holds rank 2 (``--remote-workers 1``: its key is bound to it) and asks
    for snapshots as fast as it can; capped to a quarter core where cgroups allow."""
    cap = hostile.QUARTER if hostile.cgroup_available() else None
    run = hostile.demo(free_tcp_endpoint(), keydir, REQUESTS, ["--remote-workers", "1"],
                       ["--mode", "flood", "--rank", "2"], cap)
    refused = _check_honest(run)
    s = run["summary"]
    assert refused.get("rate limited") and refused.get("muted"), refused
    assert run["peer"]["sent"] > 1000, run["peer"]
    assert s["snapshots"] < 100  # its budget (4, then 2 a second), not its flood


def test_a_flood_of_unknown_curve_keys_is_refused_at_the_handshake(keydir: Path) -> None:
    run = hostile.demo(free_tcp_endpoint(), keydir, REQUESTS, [],
                       ["--mode", "handshakes", "--sockets", "16"])
    refused = _check_honest(run)
    assert run["peer"]["handshakes"] > 16 and refused.get("handshakes"), (run["peer"], refused)
    assert set(refused) == {"handshakes"}  # nothing of theirs got to the step loop


def test_an_endpoint_that_is_a_symlink_is_refused_by_engine_and_worker(
        short_dir: Path) -> None:
    real = short_dir / "real"
    real.mkdir(mode=0o700)
    link = short_dir / "link"
    link.symlink_to(real)
    demo = subprocess.run([sys.executable, "-m", "engine_side.cli", "demo", "--no-progress",
                           "--requests", "1", "--endpoint", f"ipc://{link}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert demo.returncode != 0 and "symlink" in demo.stderr, demo.stderr[-2000:]
    worker = subprocess.run([sys.executable, "-m", "worker_side.main", "--connect",
                             f"ipc://{link}", "--ack-only", "--join-timeout", "5"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == EXIT_ENDPOINT and "symlink" in worker.stderr, worker.stderr[-2000:]
    assert list(real.iterdir()) == []  # nothing was bound or written through the link
