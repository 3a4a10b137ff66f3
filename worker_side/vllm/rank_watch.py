"""A node's liveness bound on its own ranks (``deltacast node``, or the Ray actor running it).

A rank frozen on another host (stopped, frozen by its cgroup, starved) answers neither
the engine nor its node: the engine sees its link drop and restarts the group, but the
rank never exits, so its node would never start it again.  So each rank also connects a
DEALER (no messages) to an ipc endpoint of its own in the node's private directory, named
by the generation of ranks (an older generation's links are told apart, its endpoints
unbound), and the node's ROUTER sends ZMTP heartbeats there (every twelfth of
``deltacast_liveness_s``, timeout that; a rank's I/O thread answers them, so a long
step is never taken for a freeze).  A link that drops while its rank's process is still
alive 0.03 s later is a frozen rank: SIGKILLed, its death then restarts the group (the
node's supervision sees it).  Only once the rank said it is ready (one message on its
link, its identity the rank): a cold machine's first imports can stall a starting
process past the bound.  Not thread-safe but for the watch, which owns both sockets
once started.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing.connection import wait
from typing import Any

import zmq

from protocol.calls import heartbeat_ms
from protocol.stale_dirs import LockedTempDir

_POLL_MS = 100
_EXITING_S = 0.03  # a rank whose link dropped and that is still alive this long is frozen
# (its link drops only when its process is gone or frozen: an exited one's sentinel is
# readable by the time its link's drop reaches the monitor)


class RankWatch:
    """``endpoints`` for a generation of ranks, ``watch`` their processes, ``close``."""

    def __init__(self, node: int, liveness_s: float) -> None:
        self.node, self.liveness_s = node, liveness_s
        # the node's private directory (0700, locked: a sweep removes it once its node
        # is dead, protocol.stale_dirs): its ranks' endpoints, the relay's, its ring
        self._dir = LockedTempDir("node")
        self.directory = str(self._dir.path)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        interval, timeout = heartbeat_ms(liveness_s)
        interval = max(1, interval // 3)  # (ipc: free) a freeze noticed within 0.65 s,
        # not 0.75: the engine then still hears of it within the bound's second
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._generation = 0
        self._watched: dict[str, tuple[int, Any]] = {}  # endpoint -> (rank, process)
        self._ready: set[int] = set()  # this generation's ranks that said they are ready
        self._ends: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="DeltaRankWatch")
        self._thread.start()

    def endpoints(self, ranks: range) -> dict[int, str]:
        """This generation's endpoint per rank (bound; the last generation's unbound)."""
        old, self._generation = self._ends, self._generation + 1
        ends = {r: f"ipc://{self.directory}/g{self._generation}-{r}" for r in ranks}
        for where in ends.values():
            self._sock.bind(where)
        self._ends, self._watched, self._ready = list(ends.values()), {}, set()
        for where in old:
            self._sock.unbind(where)
        return ends

    def watch(self, endpoint: str, rank: int, proc: Any) -> None:
        self._watched = {**self._watched, endpoint: (rank, proc)}

    def _watch(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_POLL_MS))
            if self._sock in events:  # a rank is ready: [its identity, b"ready"]
                ident = self._sock.recv_multipart()[0]
                if ident.isdigit():
                    self._ready.add(int(ident))
            if self._monitor not in events:
                continue
            where = recv_monitor_message(self._monitor)["endpoint"].decode(errors="replace")
            rank, proc = self._watched.get(where, (None, None))
            if proc is None or self._stop.is_set() or wait([proc.sentinel], _EXITING_S):
                continue  # not ours, or gone (its death is the supervision's)
            if rank not in self._ready:
                continue  # still starting: left to start
            print(f"deltacast node {self.node}: rank {rank} is frozen (no heartbeat for "
                  f"{self.liveness_s:g} s); killing it", file=sys.stderr, flush=True)
            proc.kill()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        stopped = not self._thread.is_alive()  # (else its sockets are left to the exit)
        if stopped:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if stopped:
            self._ctx.term()
        self._dir.close()
