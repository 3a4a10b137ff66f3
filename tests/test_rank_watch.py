"""A node's liveness bound on its ranks (worker_side.vllm.rank_watch), with real processes:
a rank that is stopped is killed past the bound; one that runs, or exits, is left alone;
a generation's endpoints replace the last one's."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any

import zmq

from worker_side.vllm.rank_watch import RankWatch

LIVENESS_S = 0.6  # the default


def _rank(endpoint: str, rank: int, seconds: float, ready: bool = True) -> None:
    """A stand-in rank: connected to its node's watch endpoint as a rank connects, ready
    at once (or never), alive ``seconds``, then gone as a rank goes (``os._exit``, the
    link still open)."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, str(rank).encode())
    sock.connect(endpoint)
    if ready:
        sock.send(b"ready")
    time.sleep(seconds)
    os._exit(0)


def _start(watch: RankWatch, ranks: range, seconds: float, ready: bool = True) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank, endpoint in watch.endpoints(ranks).items():
        p = ctx.Process(target=_rank, args=(endpoint, rank, seconds, ready), daemon=True)
        p.start()
        watch.watch(endpoint, rank, p)
        procs.append(p)
    return procs


def _wait_exit(p: Any, timeout: float) -> int | None:
    p.join(timeout)
    return p.exitcode


def test_a_stopped_rank_is_killed_and_a_running_one_is_not(capfd: Any) -> None:
    watch = RankWatch(1, LIVENESS_S)
    try:
        frozen, running = _start(watch, range(2, 4), 30)
        time.sleep(2.0)  # both connected, heartbeats flowing
        os.kill(frozen.pid, signal.SIGSTOP)
        assert _wait_exit(frozen, 10) == -signal.SIGKILL
        time.sleep(3 * LIVENESS_S)
        assert running.is_alive()  # heard all along
        assert "deltacast node 1: rank 2 is frozen (no heartbeat for 0.6 s); killing it" \
            in capfd.readouterr().err
    finally:
        watch.close()
        for p in (frozen, running):
            p.kill()
            p.join()


def test_a_rank_that_exits_is_not_taken_for_frozen_and_generations_move_on(
        capfd: Any) -> None:
    watch = RankWatch(1, LIVENESS_S)
    try:
        (first,) = _start(watch, range(1, 2), 1.5)
        assert _wait_exit(first, 20) == 0  # exited: its link dropped, no kill
        (second,) = _start(watch, range(1, 2), 30)  # the next generation's endpoint
        time.sleep(2.0)
        os.kill(second.pid, signal.SIGSTOP)
        assert _wait_exit(second, 10) == -signal.SIGKILL
        assert capfd.readouterr().err.count("is frozen") == 1
    finally:
        watch.close()
        for p in (first, second):
            p.kill()
            p.join()


def test_close_leaves_nothing_behind() -> None:
    watch = RankWatch(1, LIVENESS_S)
    directory = watch.directory  # test-only peek: the node's private directory
    assert os.path.isdir(directory)
    watch.close()
    assert not os.path.exists(directory)


def test_a_rank_that_is_not_ready_yet_is_left_to_start() -> None:
    """A starting rank (a cold machine's imports can stall it past the bound) is not
    taken for frozen: only a rank that said it is ready is watched."""
    watch = RankWatch(1, LIVENESS_S)
    try:
        (starting,) = _start(watch, range(1, 2), 30, ready=False)
        time.sleep(2.0)
        os.kill(starting.pid, signal.SIGSTOP)
        time.sleep(4 * LIVENESS_S)
        assert starting.is_alive()
    finally:
        watch.close()
        starting.kill()
        starting.join()
