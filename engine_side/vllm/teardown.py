"""What DeltaExecutor's finalizer closes, in order: its ranks (reaped), the group's
torch.distributed files, the link watch and its monitor socket, the relays' ROUTER
side, the control socket and context, the step ring and the private directory.  It runs
once (``weakref.finalize``), at shutdown or when the executor is collected, and holds
no reference to the executor itself; :func:`sigterm_deferred` keeps a SIGTERM from
cutting the shutdown short."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import zmq

from engine_side.ring import RingWriter
from engine_side.security import PrivateDir
from engine_side.spawn import reap
from engine_side.vllm.local_ranks import remove_dist_files
from engine_side.vllm.rank_deaths import LINK_POLL_MS
from engine_side.vllm.remote import RemoteRanks

JOIN_S = 10.0  # a rank's time to exit after its QUIT, before it is terminated


def teardown(procs: list[BaseProcess], deaths: list[Connection], sock: zmq.Socket[bytes],
             ctx: zmq.Context[zmq.Socket[bytes]], private: PrivateDir, ring: RingWriter | None,
             remote: RemoteRanks | None, links: zmq.Socket[bytes], link_watch: threading.Thread,
             dist: list[str]) -> None:
    """Close everything; ``dist[0]``: the group's torch.distributed init method."""
    reap(procs, deaths, JOIN_S)
    remove_dist_files(dist[0])
    if link_watch.is_alive():  # it ends within its poll period once shutting down
        link_watch.join(2 * LINK_POLL_MS / 1e3)
    if not link_watch.is_alive():  # (else its socket is left to the process's exit)
        sock.disable_monitor()
        links.close(linger=0)
    if remote is not None:
        remote.close()
    sock.close(linger=0)
    ctx.term()
    if ring is not None:
        ring.close()
    private.close()


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """SIGTERM held for the block and delivered when it ends (in the main thread; in
    another the block runs as it is).  vLLM's engine core restores SIGTERM's default
    action before it shuts its executor down, and ``vllm serve`` sends one as it starts
    to drain (``--shutdown-timeout`` > 0): it would end the teardown half way and leave
    the run's directory.  vLLM's SIGKILL past its timeout still ends it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)
        if held:
            signal.raise_signal(signal.SIGTERM)
